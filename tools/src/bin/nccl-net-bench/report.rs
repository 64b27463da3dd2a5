//! What a run produced, one row per size, and its two text forms: the printed table and the
//! `--csv` file (which `--plot` and `--compare` read back).
//!
//! Both forms are an interface: vm-tier.sh and perf/perf-vm-inner.sh read the CSV's
//! columns (`size_bytes,bandwidth_gbps,latency_us`, an empty field for a phase not run),
//! and people compare tables across runs, so their formats stay exactly as they are.

use std::{fmt::Write as _, path::Path};

use crate::Res;

/// One line of the result table; a phase that did not run is `None`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row {
    pub size: usize,
    pub gbps: Option<f64>,
    pub lat_us: Option<f64>,
}

/// What a run produced, one row per size (what the table, the CSV file and the plot are
/// made from), with what the plot says about it.
pub struct Report {
    pub rows: Vec<Row>,
    /// The plot's title: transport, device, window, group, connections.
    pub title: String,
    /// Lines under the title.
    pub notes: Vec<String>,
    /// The legend name of this run's series.
    pub label: String,
}

impl Report {
    /// `--plot`: the report of an earlier run, from its CSV.
    pub fn from_csv(csv: &Path) -> Res<Report> {
        let name = csv
            .file_stem()
            .map_or_else(|| "run".into(), |n| n.to_string_lossy().into_owned());
        Ok(Report {
            rows: read_csv(csv)?,
            title: format!("nccl-net-bench: {name}"),
            notes: vec![format!("from {}", csv.display())],
            label: name,
        })
    }
}

/// `size` in the largest binary unit that divides it: `8 B`, `4 KiB`, `64 MiB`.
pub fn human(size: usize) -> String {
    match size {
        s if s >= 1 << 30 && s % (1 << 30) == 0 => format!("{} GiB", s >> 30),
        s if s >= 1 << 20 && s % (1 << 20) == 0 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 && s % (1 << 10) == 0 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

pub const TABLE_HEAD: &str = "      size        GB/s      lat us";

pub fn table_row(r: &Row) -> String {
    let cell = |v: Option<f64>, decimals: usize| {
        v.map_or_else(|| format!("{:>11}", "-"), |v| format!("{v:>11.decimals$}"))
    };
    format!(
        "{:>10} {} {}",
        human(r.size),
        cell(r.gbps, 4),
        cell(r.lat_us, 2)
    )
}

const CSV_HEAD: &str = "size_bytes,bandwidth_gbps,latency_us";

pub fn write_csv(report: &Report, path: &Path) -> Res<()> {
    let mut out = format!("{CSV_HEAD}\n");
    let cell =
        |v: Option<f64>, decimals: usize| v.map_or(String::new(), |v| format!("{v:.decimals$}"));
    for r in &report.rows {
        let _ = writeln!(out, "{},{},{}", r.size, cell(r.gbps, 6), cell(r.lat_us, 3));
    }
    std::fs::write(path, out).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// Reads rows in the `--csv` format (a header line, then `size,GB/s,us`; empty or `-`
/// fields are phases not run).
pub fn read_csv(path: &Path) -> Res<Vec<Row>> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let mut rows = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("size") {
            continue;
        }
        let bad = || {
            format!(
                "{}:{}: expected {CSV_HEAD}, got {line:?}",
                path.display(),
                n + 1
            )
        };
        let mut f = line.split(',').map(str::trim);
        let size = f.next().and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        let mut value = || -> Res<Option<f64>> {
            match f.next() {
                None | Some("" | "-") => Ok(None),
                Some(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|v| v.is_finite() && *v >= 0.0)
                    .map(Some)
                    .ok_or_else(bad),
            }
        };
        let (gbps, lat_us) = (value()?, value()?);
        rows.push(Row { size, gbps, lat_us });
    }
    if rows.is_empty() {
        return Err(format!("{}: no rows", path.display()));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trips_with_missing_phases() {
        let rows = vec![
            Row {
                size: 8,
                gbps: Some(0.5),
                lat_us: None,
            },
            Row {
                size: 1 << 20,
                gbps: None,
                lat_us: Some(12.25),
            },
        ];
        let report = Report {
            rows: rows.clone(),
            title: "t".into(),
            notes: vec![],
            label: "l".into(),
        };
        let path = std::env::temp_dir().join(format!("nccl-net-bench-{}.csv", std::process::id()));
        write_csv(&report, &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text,
            "size_bytes,bandwidth_gbps,latency_us\n8,0.500000,\n1048576,,12.250\n"
        );
        assert_eq!(read_csv(&path).unwrap(), rows);
        let from = Report::from_csv(&path).unwrap();
        assert_eq!(from.rows, rows);
        assert_eq!(from.label, format!("nccl-net-bench-{}", std::process::id()));
        std::fs::write(&path, "size_bytes,bandwidth_gbps,latency_us\n8,x,1\n").unwrap();
        assert!(read_csv(&path)
            .unwrap_err()
            .contains(":2: expected size_bytes"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn table_rows_keep_their_columns() {
        let row = Row {
            size: 4096,
            gbps: Some(0.470513),
            lat_us: Some(7.243),
        };
        assert_eq!(table_row(&row), "     4 KiB      0.4705        7.24");
        assert_eq!(table_row(&row).len(), TABLE_HEAD.len());
        let row = Row {
            size: 8,
            gbps: None,
            lat_us: Some(6.862),
        };
        assert_eq!(table_row(&row), "       8 B           -        6.86");
        assert_eq!(
            (human(3 << 30), human(1000)),
            ("3 GiB".into(), "1000 B".into())
        );
    }
}
