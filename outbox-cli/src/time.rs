//! Times and ages on the command line.
//!
//! A **time** (`--since`, `--until`, `--sent-before`, ...) is one of:
//! - RFC 3339 with an offset: `2024-05-01T12:00:00Z`, `2024-05-01T14:00:00+02:00`;
//! - a date, meaning its midnight UTC: `2024-05-01`;
//! - `now`;
//! - an age, meaning that long before now (this machine's clock): `90s`, `15m`, `12h`,
//!   `7d`, `2w`.
//!
//! An **age** (`--sent-older-than`, ...) is a whole number followed by `s`, `m`, `h`,
//! `d` or `w`.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};

const HINT: &str = "use RFC 3339 (2024-05-01T12:00:00Z), a date (2024-05-01, midnight UTC), `now`, \
                    or an age before now such as 90s, 15m, 12h, 7d, 2w";

/// A duration: an age (`parse_age`), or milliseconds (`500ms`).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match text.trim().strip_suffix("ms") {
        Some(ms) if !ms.is_empty() && ms.bytes().all(|b| b.is_ascii_digit()) => ms
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| format!("{text:?} is too large")),
        _ => parse_age(text),
    }
}

/// Parses an age such as `7d`.
pub fn parse_age(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit; write e.g. {text}s, {text}h or {text}d"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| {
        format!("{text:?} is not an age; write a whole number and a unit: 90s, 15m, 12h, 7d, 2w")
    })?;
    let secs = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => {
            return Err(format!(
                "{text:?} has unknown unit {unit:?}; use s, m, h, d or w (e.g. 7d)"
            ));
        }
    };
    n.checked_mul(secs)
        .filter(|s| *s <= 100 * 365 * 86_400)
        .map(Duration::from_secs)
        .ok_or_else(|| format!("{text:?} is longer than 100 years"))
}

/// Parses a point in time; relative forms count back from `now`.
pub fn parse_time_at(text: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("now") {
        return Ok(now);
    }
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(text, "%Y-%m-%d")
        && let Some(t) = d.and_hms_opt(0, 0, 0)
    {
        return Ok(t.and_utc());
    }
    if text.starts_with(|c: char| c.is_ascii_digit())
        && text.ends_with(['s', 'm', 'h', 'd', 'w'])
        && let Ok(age) = parse_age(text)
    {
        let age = chrono::Duration::from_std(age).map_err(|e| e.to_string())?;
        return now
            .checked_sub_signed(age)
            .ok_or_else(|| format!("{text:?} is too far in the past"));
    }
    if text.contains('T') && !text.ends_with(['Z', 'z']) && !text.contains(['+']) {
        return Err(format!(
            "{text:?} has no time zone; add `Z` for UTC or an offset such as +02:00"
        ));
    }
    Err(format!("{text:?} is not a time; {HINT}"))
}

/// Parses a point in time relative to this machine's clock (for clap).
pub fn parse_time(text: &str) -> Result<DateTime<Utc>, String> {
    parse_time_at(text, Utc::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::parse_from_rfc3339("2024-05-10T12:00:00Z")
            .expect("valid")
            .with_timezone(&Utc)
    }

    #[test]
    fn ages() {
        assert_eq!(parse_age("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_age("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_age("12h"), Ok(Duration::from_secs(43_200)));
        assert_eq!(parse_age("7d"), Ok(Duration::from_secs(604_800)));
        assert_eq!(parse_age("2w"), Ok(Duration::from_secs(1_209_600)));
        assert_eq!(parse_age("0d"), Ok(Duration::ZERO));
        for bad in [
            "7",
            "d",
            "7x",
            "-7d",
            "1.5h",
            "7 days",
            "",
            "99999999999999w",
        ] {
            assert!(parse_age(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn times() {
        let at = |s| parse_time_at(s, now());
        assert_eq!(at("now"), Ok(now()));
        assert_eq!(at("2024-05-10T12:00:00Z"), Ok(now()));
        assert_eq!(at("2024-05-10T14:00:00+02:00"), Ok(now()));
        assert_eq!(
            at("2024-05-10").map(|t| t.to_rfc3339()),
            Ok("2024-05-10T00:00:00+00:00".to_owned())
        );
        assert_eq!(
            at("7d").map(|t| t.to_rfc3339()),
            Ok("2024-05-03T12:00:00+00:00".to_owned())
        );
        assert_eq!(
            at("12h").map(|t| t.to_rfc3339()),
            Ok("2024-05-10T00:00:00+00:00".to_owned())
        );
        let err = at("2024-05-10T12:00:00").expect_err("no zone");
        assert!(err.contains("no time zone"), "{err}");
        for bad in ["yesterday", "2024-13-01", "7x", "", "10/05/2024"] {
            let err = at(bad).expect_err(bad);
            assert!(
                err.contains("not a time") || err.contains("unit"),
                "{bad:?}: {err}"
            );
        }
    }
}
