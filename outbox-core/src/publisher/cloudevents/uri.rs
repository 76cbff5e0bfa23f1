//! RFC 3986 `URI-reference` (section 4.1), the type of the CloudEvents `source`
//! attribute: a parser that says where and why a string is not one. It never panics
//! and allocates nothing; every index it takes is of an ASCII byte, checked first.

/// Why `text` is not a URI-reference: the first problem found, with the byte offset
/// where it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotUriReference {
    /// Byte offset of the problem in the input.
    pub(crate) at: usize,
    /// What is wrong there, for a sentence ("... at byte 3: {what}").
    pub(crate) what: &'static str,
}

type Checked = Result<(), NotUriReference>;

fn fail(at: usize, what: &'static str) -> Checked {
    Err(NotUriReference { at, what })
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn sub_delim(b: u8) -> bool {
    matches!(
        b,
        b'!' | b'$' | b'&' | b'\'' | b'(' | b')' | b'*' | b'+' | b',' | b';' | b'='
    )
}

/// Checks `s` (at `offset` of the whole input) as a run of `allowed` bytes and
/// percent-encoded octets (`%` and two hex digits).
fn run(s: &[u8], offset: usize, allowed: impl Fn(u8) -> bool, what: &'static str) -> Checked {
    let mut i = 0;
    while i < s.len() {
        let b = s[i];
        if b == b'%' {
            let hex = |j: usize| s.get(j).is_some_and(u8::is_ascii_hexdigit);
            if !(hex(i + 1) && hex(i + 2)) {
                return fail(
                    offset + i,
                    "`%` must start a percent-encoded octet (`%` and two hex digits, e.g. `%25` for `%` itself)",
                );
            }
            i += 3;
        } else if allowed(b) {
            i += 1;
        } else {
            return fail(offset + i, what);
        }
    }
    Ok(())
}

const NOT_ALLOWED: &str = "this character is not allowed in a URI; percent-encode it (its UTF-8 bytes as `%XX`, e.g. `é` as `%C3%A9`, a space as `%20`)";

fn pchar(b: u8) -> bool {
    unreserved(b) || sub_delim(b) || matches!(b, b':' | b'@')
}

/// Checks `text` as an RFC 3986 URI-reference (a URI, or a relative reference).
pub(crate) fn check(text: &str) -> Checked {
    let s = text.as_bytes();
    // Fragment and query: after the first `#`, and the first `?` before it.
    let (rest, fragment) = match s.iter().position(|&b| b == b'#') {
        Some(i) => (&s[..i], Some((i + 1, &s[i + 1..]))),
        None => (s, None),
    };
    let (rest, query) = match rest.iter().position(|&b| b == b'?') {
        Some(i) => (&rest[..i], Some((i + 1, &rest[i + 1..]))),
        None => (rest, None),
    };
    let tail = |b: u8| pchar(b) || matches!(b, b'/' | b'?');
    if let Some((at, q)) = query {
        run(q, at, tail, NOT_ALLOWED)?;
    }
    if let Some((at, f)) = fragment {
        run(f, at, tail, NOT_ALLOWED)?;
    }
    // A scheme: letters, digits, `+-.`, starting with a letter, before the first `:`
    // that comes before any `/`.
    let mut start = 0;
    if let Some(colon) = rest.iter().position(|&b| matches!(b, b':' | b'/'))
        && rest[colon] == b':'
    {
        let scheme = &rest[..colon];
        let valid = scheme.first().is_some_and(u8::is_ascii_alphabetic)
            && scheme
                .iter()
                .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'));
        if !valid {
            // Not a scheme, so a relative path whose first segment has a `:`.
            return fail(
                colon,
                "a `:` in the first segment of a relative reference reads as the end of a scheme (letters, digits, `+-.`, starting with a letter); start with `./` or percent-encode it as `%3A`",
            );
        }
        start = colon + 1;
    }
    let rest = &rest[start..];
    let mut path_at = start;
    let path = if rest.starts_with(b"//") {
        let authority_end = rest[2..]
            .iter()
            .position(|&b| b == b'/')
            .map_or(rest.len(), |i| i + 2);
        authority(&rest[2..authority_end], start + 2)?;
        path_at = start + authority_end;
        &rest[authority_end..]
    } else {
        rest
    };
    run(
        path,
        path_at,
        |b| pchar(b) || b == b'/',
        if path.contains(&b'[') || path.contains(&b']') {
            "`[` and `]` are only allowed around an IP address in the host; percent-encode them (`%5B`, `%5D`)"
        } else {
            NOT_ALLOWED
        },
    )
}

/// `[ userinfo "@" ] host [ ":" port ]`, at `offset`.
fn authority(s: &[u8], offset: usize) -> Checked {
    let (host_at, hostport) = match s.iter().position(|&b| b == b'@') {
        Some(i) => {
            run(
                &s[..i],
                offset,
                |b| unreserved(b) || sub_delim(b) || b == b':',
                NOT_ALLOWED,
            )?;
            (i + 1, &s[i + 1..])
        }
        None => (0, s),
    };
    let offset = offset + host_at;
    let (host_len, port) = if hostport.first() == Some(&b'[') {
        let Some(close) = hostport.iter().position(|&b| b == b']') else {
            return fail(
                offset,
                "an IP literal host opened with `[` must be closed with `]`",
            );
        };
        ip_literal(&hostport[1..close], offset + 1)?;
        match hostport.get(close + 1) {
            None => (close + 1, None),
            Some(b':') => (close + 1, Some(&hostport[close + 2..])),
            Some(_) => {
                return fail(
                    offset + close + 1,
                    "after an IP literal host comes `:port`, a `/`, `?` or `#`",
                );
            }
        }
    } else {
        match hostport.iter().position(|&b| b == b':') {
            Some(i) => (i, Some(&hostport[i + 1..])),
            None => (hostport.len(), None),
        }
    };
    if hostport.first() != Some(&b'[') {
        run(
            &hostport[..host_len],
            offset,
            |b| unreserved(b) || sub_delim(b),
            "this character is not allowed in a host name; percent-encode it",
        )?;
    }
    if let Some(port) = port
        && let Some(i) = port.iter().position(|b| !b.is_ascii_digit())
    {
        return fail(
            offset + host_len + 1 + i,
            "a port is digits only (and the host name cannot hold a `:`)",
        );
    }
    Ok(())
}

/// The inside of `[...]`: an IPv6 address or `v<hex>.<text>` (IPvFuture).
fn ip_literal(s: &[u8], offset: usize) -> Checked {
    if let Some(b'v' | b'V') = s.first() {
        let dot = s.iter().position(|&b| b == b'.');
        let valid = dot.is_some_and(|d| {
            d > 1
                && s[1..d].iter().all(u8::is_ascii_hexdigit)
                && d + 1 < s.len()
                && s[d + 1..]
                    .iter()
                    .all(|&b| unreserved(b) || sub_delim(b) || b == b':')
        });
        return if valid {
            Ok(())
        } else {
            fail(offset, "not an IPvFuture address (`v<hex digits>.<text>`)")
        };
    }
    if ipv6(s) {
        Ok(())
    } else {
        fail(offset, "not an IPv6 address")
    }
}

fn ipv4(s: &[u8]) -> bool {
    let mut parts = 0;
    for part in s.split(|&b| b == b'.') {
        parts += 1;
        let valid = match part {
            [d] => d.is_ascii_digit(),
            [b'1'..=b'9', d] => d.is_ascii_digit(),
            [b'1', d, e] => d.is_ascii_digit() && e.is_ascii_digit(),
            [b'2', b'0'..=b'4', e] => e.is_ascii_digit(),
            [b'2', b'5', b'0'..=b'5'] => true,
            _ => false,
        };
        if !valid {
            return false;
        }
    }
    parts == 4
}

fn ipv6(s: &[u8]) -> bool {
    // Pieces of 16 bits on each side of an optional `::`; an IPv4 tail counts two.
    fn pieces(side: &[u8], last: bool) -> Option<usize> {
        if side.is_empty() {
            return Some(0);
        }
        let groups: Vec<&[u8]> = side.split(|&b| b == b':').collect();
        let mut n = 0;
        for (i, g) in groups.iter().enumerate() {
            if last && i + 1 == groups.len() && g.contains(&b'.') {
                if !ipv4(g) {
                    return None;
                }
                n += 2;
            } else if (1..=4).contains(&g.len()) && g.iter().all(u8::is_ascii_hexdigit) {
                n += 1;
            } else {
                return None;
            }
        }
        Some(n)
    }
    let double = s.windows(2).position(|w| w == b"::");
    match double {
        Some(i) => {
            let (left, right) = (&s[..i], &s[i + 2..]);
            if right.windows(2).any(|w| w == b"::") {
                return false;
            }
            // An IPv4 tail comes last: after the `::`, or in the form without one.
            match (pieces(left, false), pieces(right, true)) {
                (Some(l), Some(r)) => l + r <= 7,
                _ => false,
            }
        }
        None => pieces(s, true) == Some(8),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `cloudevents_source` fuzz target (CI, 2026-12-02): an IPv4 part before
    /// a closing `::` was taken for the address's IPv4 tail.
    #[test]
    fn an_ipv4_part_before_a_closing_double_colon_is_not_an_ipv6_address() {
        for bad in ["//[2.112.122.1::]", "//[1::2.3.4.5::]", "//[a:1.2.3.4::]"] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
        assert_eq!(check("//[a::1.2.3.4]"), Ok(()));
    }

    #[test]
    fn uri_references_are_accepted() {
        for good in [
            "/orders-service",
            "urn:example:orders",
            "https://example.com/orders?x=1#top",
            "//host:8080/a",
            "mailto:orders@example.com",
            "./a:b",
            "a/b/c",
            "",
            "#frag",
            "?q",
            "/d%C3%A9p%C3%B4t",
            "http://[::1]:80/",
            "http://[2001:db8::7]/c=GB?objectClass?one",
            "http://[::ffff:192.0.2.1]/",
            "http://[v7.fe80::a+en1]/",
            "http://user:pw@host/",
            "tel:+1-816-555-1212",
            "http://a/b/c/g;x?y#s",
            "http://host:/",
        ] {
            assert_eq!(check(good), Ok(()), "{good:?}");
        }
    }

    #[test]
    fn other_strings_are_refused_with_the_place() {
        for (bad, at) in [
            ("/dépôt", 2),
            ("/dépôt/\"ü\"%", 2),
            ("/a b", 2),
            ("/100%", 4),
            ("/%zz", 1),
            ("a:b:c d", 5),
            ("1a:b", 2),
            ("http://[::1/", 7),
            ("http://[12345::]/", 8),
            ("http://host:80a/", 14),
            ("/a[b]", 2),
            ("#a#b", 2),
            ("http://ho st/", 9),
            ("\n", 0),
        ] {
            let err = check(bad).expect_err(bad);
            assert_eq!(err.at, at, "{bad:?}: {err:?}");
        }
    }
}
