//! PNG charts: block hit rate against capacity, one line per policy, with Belady (the offline
//! optimum) and an unbounded cache (a horizontal line) bounding every online policy.

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::prelude::*;

use super::sweep::{erased::Name, Engine, Policy, Row, Scenario};

/// DejaVu Sans (Bitstream Vera licence, see benches/assets/DejaVuSans.LICENSE), embedded so
/// charts render on machines without fonts.
const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Draws one chart per (engine, nodes, scenario) group that has at least two capacities, into
/// `dir`; returns the files written. Runs over a disk tier are left out: a chart compares DRAM
/// policies.
pub fn hit_rate_charts(rows: &[Row], dir: &Path, title: &str) -> anyhow::Result<Vec<PathBuf>> {
    // Registering twice is harmless; ignore "already registered".
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let mut groups: Vec<(Engine, u32, Scenario)> = rows
        .iter()
        .map(|r| (r.engine, r.nodes, r.scenario))
        .collect();
    groups.dedup();
    groups.sort_by_key(|g| (g.0 as u8, g.1, g.2 as u8));
    groups.dedup();
    let mut written = Vec::new();
    for (engine, nodes, scenario) in groups {
        let group: Vec<&Row> = rows
            .iter()
            .filter(|r| r.engine == engine && r.nodes == nodes && r.scenario == scenario)
            .filter(|r| r.disk.is_none())
            .collect();
        let mut caps: Vec<u64> = group
            .iter()
            .filter(|r| r.capacity_blocks > 0)
            .map(|r| r.capacity_blocks)
            .collect();
        caps.sort_unstable();
        caps.dedup();
        if caps.len() < 2 {
            continue;
        }
        let file = dir.join(format!(
            "hit-rate-{}-{}nodes-{}.png",
            engine.name(),
            nodes,
            scenario.name()
        ));
        draw(
            &group,
            &caps,
            &file,
            &format!(
                "{title}: {} engine, {nodes} node(s), {}",
                engine.name(),
                scenario.name()
            ),
        )
        .with_context(|| format!("drawing {}", file.display()))?;
        written.push(file);
    }
    Ok(written)
}

fn draw(rows: &[&Row], caps: &[u64], file: &Path, title: &str) -> anyhow::Result<()> {
    let root = BitMapBackend::new(file, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let (lo, hi) = (caps[0] as f64, *caps.last().expect("two") as f64);
    let top = rows.iter().map(|r| r.block_hit_rate).fold(0.0f64, f64::max) * 100.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..(top * 1.1).max(1.0))?;
    chart
        .configure_mesh()
        .x_desc("capacity per node (blocks)")
        .x_labels(6)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .y_desc("block hit rate (%)")
        .label_style(("sans-serif", 15))
        .draw()?;
    let style = |p: Policy| match p {
        Policy::Lru => RGBColor(31, 119, 180),
        Policy::PrefixAware => RGBColor(148, 103, 189),
        Policy::S3fifo => RGBColor(214, 39, 40),
        Policy::S3fifoLru => RGBColor(255, 127, 14),
        Policy::HitDensity => RGBColor(23, 190, 207),
        Policy::Belady => RGBColor(44, 160, 44),
        Policy::Unbounded => RGBColor(127, 127, 127),
    };
    let mut policies: Vec<Policy> = rows.iter().map(|r| r.policy).collect();
    policies.sort();
    policies.dedup();
    for p in policies {
        let color = style(p);
        let mut pts: Vec<(f64, f64)> = if p == Policy::Unbounded {
            let rate = rows
                .iter()
                .find(|r| r.policy == p)
                .map_or(0.0, |r| r.block_hit_rate * 100.0);
            vec![(lo, rate), (hi, rate)]
        } else {
            rows.iter()
                .filter(|r| r.policy == p)
                .map(|r| (r.capacity_blocks as f64, r.block_hit_rate * 100.0))
                .collect()
        };
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let label = match p {
            Policy::Belady => "belady (offline optimum)".to_string(),
            Policy::Unbounded => "unbounded (ceiling)".to_string(),
            other if other == Policy::pool_default() => format!("{} (default)", other.name()),
            other => other.name(),
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(3)))?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
            });
        if p != Policy::Unbounded {
            chart.draw_series(
                pts.iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
            )?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
