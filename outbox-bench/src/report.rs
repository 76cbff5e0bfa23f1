//! Collects measurements; prints a table, writes JSON and an SVG chart.

use std::fmt::Write as _;

use crate::BoxError;
use crate::setup::Args;

pub struct Row {
    pub scenario: String,
    pub name: String,
    pub value: f64,
    pub unit: String,
    /// Whether the figure met its target, for rows that have one.
    pub met: Option<bool>,
}

/// A bound a figure must meet. A missed target is printed at the end of the run and, with
/// `--check`, fails it (exit code 3).
#[derive(Clone, Copy, Debug)]
pub enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    fn met(self, value: f64) -> bool {
        match self {
            Target::AtLeast(t) => value >= t,
            Target::AtMost(t) => value <= t,
        }
    }

    fn describe(self) -> String {
        match self {
            Target::AtLeast(t) => format!("target >= {t}"),
            Target::AtMost(t) => format!("target <= {t}"),
        }
    }
}

pub struct Report {
    rows: Vec<Row>,
    out: String,
    command: String,
}

impl Report {
    pub fn new(args: &Args) -> Report {
        Report {
            rows: Vec::new(),
            out: args.out.clone(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
        }
    }

    pub fn add(&mut self, scenario: &str, name: &str, value: f64, unit: &str) {
        eprintln!("  {name}: {value:.3} {unit}");
        self.rows.push(Row {
            scenario: scenario.to_owned(),
            name: name.to_owned(),
            value,
            unit: unit.to_owned(),
            met: None,
        });
    }

    /// A ratio with its target (a NaN, from a figure that could not be measured, misses).
    pub fn target(&mut self, scenario: &str, name: &str, value: f64, target: Target) {
        self.target_in(scenario, name, value, "ratio", target);
    }

    /// A figure in `unit` with its target.
    pub fn target_in(
        &mut self,
        scenario: &str,
        name: &str,
        value: f64,
        unit: &str,
        target: Target,
    ) {
        let met = target.met(value);
        let unit = format!(
            "{unit} ({}){}",
            target.describe(),
            if met { "" } else { " MISSED" }
        );
        self.add(scenario, name, value, &unit);
        if let Some(row) = self.rows.last_mut() {
            row.met = Some(met);
        }
    }

    /// The rows whose target was missed.
    pub fn missed(&self) -> Vec<&Row> {
        self.rows.iter().filter(|r| r.met == Some(false)).collect()
    }

    /// Prints the Markdown table and writes `results.json` and `throughput.svg`.
    pub fn finish(&self) -> Result<(), BoxError> {
        let mut md =
            String::from("| scenario | measurement | value | unit |\n| --- | --- | ---: | --- |\n");
        for r in &self.rows {
            let value = if r.value.abs() >= 100.0 {
                format!("{:.0}", r.value)
            } else {
                format!("{:.2}", r.value)
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} |",
                r.scenario, r.name, value, r.unit
            );
        }
        println!("{md}");
        std::fs::create_dir_all(&self.out)?;
        let json = serde_json::json!({
            "command": self.command,
            "date": chrono::Utc::now().to_rfc3339(),
            "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "results": self.rows.iter().map(|r| serde_json::json!({
                "scenario": r.scenario, "measurement": r.name, "value": r.value, "unit": r.unit,
                "met": r.met,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(
            format!("{}/results.json", self.out),
            serde_json::to_string_pretty(&json)?,
        )?;
        let bars: Vec<&Row> = self.rows.iter().filter(|r| r.unit == "events/s").collect();
        if !bars.is_empty() {
            std::fs::write(
                format!("{}/throughput.svg", self.out),
                bar_chart("Throughput (events/s)", &bars),
            )?;
        }
        eprintln!("wrote {0}/results.json and {0}/throughput.svg", self.out);
        let missed = self.missed();
        let targets = self.rows.iter().filter(|r| r.met.is_some()).count();
        eprintln!("targets: {} of {targets} met", targets - missed.len());
        for r in missed {
            eprintln!(
                "  MISSED {}: {}: {:.3} {}",
                r.scenario, r.name, r.value, r.unit
            );
        }
        Ok(())
    }
}

/// A horizontal bar chart, one bar per row, as a standalone SVG document.
fn bar_chart(title: &str, rows: &[&Row]) -> String {
    let max = rows
        .iter()
        .map(|r| r.value)
        .fold(0.0_f64, f64::max)
        .max(1.0);
    let (label_w, bar_w, row_h) = (330.0, 420.0, 26.0);
    let height = 40.0 + row_h * rows.len() as f64;
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="14" font-weight="bold">{title}</text>
"#,
        w = label_w + bar_w + 90.0
    );
    for (i, r) in rows.iter().enumerate() {
        let y = 32.0 + row_h * i as f64;
        let w = bar_w * r.value / max;
        let _ = write!(
            svg,
            r##"<text x="{lx}" y="{ty}" text-anchor="end">{scenario}: {name}</text>
<rect x="{label_w}" y="{y}" width="{w:.1}" height="{bh}" fill="#4472c4"/>
<text x="{vx:.1}" y="{ty}">{value:.0}</text>
"##,
            lx = label_w - 6.0,
            ty = y + 14.0,
            bh = row_h - 8.0,
            vx = label_w + w + 4.0,
            scenario = xml(&r.scenario),
            name = xml(&r.name),
            value = r.value
        );
    }
    svg.push_str("</svg>\n");
    svg
}

fn xml(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
