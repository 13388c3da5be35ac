//! Hand-written SVG charts: grouped bars, lines and scatter plots. Enough for the
//! benchmark's figures without a plotting dependency; the output is plain, diffable text.

use std::fmt::Write as _;

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 56.0;
const BOTTOM: f64 = 64.0;

/// Colours that stay apart for readers with common colour-vision deficiencies.
pub const BLUE: &str = "#0072B2";
pub const ORANGE: &str = "#E69F00";
pub const RED: &str = "#D55E00";
pub const GREY: &str = "#777777";

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn header(title: &str, subtitle: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="24" font-size="16" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="42" fill="#555">{}</text>"##,
        esc(subtitle)
    );
    s
}

/// Ticks for a linear axis from 0 to at least `max`: steps of 1, 2 or 5 x 10^k.
fn nice_ticks(max: f64) -> (f64, Vec<f64>) {
    let max = if max > 0.0 { max } else { 1.0 };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let top = (max / step).ceil() * step;
    let n = (top / step).round() as usize;
    (top, (0..=n).map(|i| i as f64 * step).collect())
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        let s = format!("{v:.1}");
        s.trim_end_matches(".0").to_string()
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn legend(s: &mut String, items: &[(&str, &str)]) {
    let mut x = W - RIGHT;
    for (name, color) in items.iter().rev() {
        let width = 22.0 + 7.0 * name.len() as f64;
        x -= width;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{color}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            TOP - 14.0,
            x + 16.0,
            TOP - 3.5,
            esc(name)
        );
    }
}

/// Bars grouped by category, one bar per series, values labelled.
pub fn bars(
    title: &str,
    subtitle: &str,
    y_label: &str,
    categories: &[String],
    series: &[(&str, &str, Vec<f64>)],
) -> String {
    let mut s = header(title, subtitle);
    let max = series
        .iter()
        .flat_map(|(_, _, v)| v.iter().copied())
        .fold(0.0, f64::max);
    let (top, ticks) = nice_ticks(max * 1.08);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let y = |v: f64| TOP + ph - v / top * ph;
    axes_y(&mut s, &ticks, y, y_label);
    let group = pw / categories.len().max(1) as f64;
    let bar = (group * 0.7) / series.len().max(1) as f64;
    for (ci, cat) in categories.iter().enumerate() {
        let gx = LEFT + ci as f64 * group + group * 0.15;
        for (si, (_, color, values)) in series.iter().enumerate() {
            let v = values.get(ci).copied().unwrap_or(0.0);
            let x = gx + si as f64 * bar;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{color}"/>"#,
                y(v),
                bar - 4.0,
                (TOP + ph - y(v)).max(0.0)
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x + (bar - 4.0) / 2.0,
                y(v) - 4.0,
                bar_label(v)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            gx + group * 0.35,
            TOP + ph + 18.0,
            esc(cat)
        );
    }
    let names: Vec<(&str, &str)> = series.iter().map(|(n, c, _)| (*n, *c)).collect();
    legend(&mut s, &names);
    s.push_str("</svg>\n");
    s
}

/// Three significant digits, at most two decimals.
fn bar_label(v: f64) -> String {
    match v.abs() {
        a if a >= 100.0 => format!("{v:.0}"),
        a if a >= 10.0 => format!("{v:.1}"),
        _ => format!("{v:.2}"),
    }
}

fn axes_y(s: &mut String, ticks: &[f64], y: impl Fn(f64) -> f64, label: &str) {
    for &t in ticks {
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#e3e3e3"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            W - RIGHT,
            y(t),
            y(t),
            LEFT - 6.0,
            y(t) + 4.0,
            fmt_tick(t)
        );
    }
    let _ = writeln!(
        s,
        r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
        TOP + (H - TOP - BOTTOM) / 2.0,
        esc(label)
    );
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{:.1}" stroke="#333"/><line x1="{LEFT}" x2="{:.1}" y1="{:.1}" y2="{:.1}" stroke="#333"/>"##,
        H - BOTTOM,
        W - RIGHT,
        H - BOTTOM,
        H - BOTTOM
    );
}

/// A series of points, drawn as a line or as dots.
pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
    pub dots: bool,
}

/// Lines or dots over an x axis with given ticks; `log_y` for values spanning decades.
pub struct Plot<'a> {
    pub title: &'a str,
    pub subtitle: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub x_ticks: Vec<(f64, String)>,
    pub x_max: f64,
    pub log_y: bool,
    /// Vertical markers: (x, label).
    pub markers: Vec<(f64, String)>,
}

impl Plot<'_> {
    pub fn render(&self, series: &[Series<'_>]) -> String {
        let mut s = header(self.title, self.subtitle);
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let ys = series.iter().flat_map(|se| se.points.iter().map(|p| p.1));
        let max = ys.clone().fold(0.0, f64::max);
        let x = |v: f64| LEFT + v / self.x_max * pw;
        if self.log_y {
            let min = ys.filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
            let lo = 10f64.powf(min.max(1e-4).log10().floor());
            let hi = 10f64.powf(max.max(lo * 10.0).log10().ceil());
            let y = |v: f64| {
                let v = v.max(lo);
                TOP + ph - (v / lo).log10() / (hi / lo).log10() * ph
            };
            let mut ticks = Vec::new();
            let mut t = lo;
            while t <= hi * 1.0001 {
                ticks.push(t);
                t *= 10.0;
            }
            axes_y(&mut s, &ticks, y, self.y_label);
            self.body(&mut s, series, x, y);
        } else {
            let (top, ticks) = nice_ticks(max * 1.05);
            let y = |v: f64| TOP + ph - v / top * ph;
            axes_y(&mut s, &ticks, y, self.y_label);
            self.body(&mut s, series, x, y);
        }
        s.push_str("</svg>\n");
        s
    }

    fn body(
        &self,
        s: &mut String,
        series: &[Series<'_>],
        x: impl Fn(f64) -> f64,
        y: impl Fn(f64) -> f64,
    ) {
        for (v, label) in &self.x_ticks {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                x(*v),
                H - BOTTOM + 18.0,
                esc(label)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + (W - LEFT - RIGHT) / 2.0,
            H - 16.0,
            esc(self.x_label)
        );
        for (v, label) in &self.markers {
            let _ = writeln!(
                s,
                r##"<line x1="{:.1}" x2="{:.1}" y1="{TOP}" y2="{:.1}" stroke="#999" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#555">{}</text>"##,
                x(*v),
                x(*v),
                H - BOTTOM,
                x(*v) + 4.0,
                TOP + 12.0,
                esc(label)
            );
        }
        for se in series {
            if se.dots {
                for &(px, py) in &se.points {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="1.6" fill="{}" fill-opacity="0.6"/>"#,
                        x(px),
                        y(py),
                        se.color
                    );
                }
            } else {
                let path: Vec<String> = se
                    .points
                    .iter()
                    .map(|&(px, py)| format!("{:.1},{:.1}", x(px), y(py)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
                    se.color,
                    path.join(" ")
                );
            }
        }
        let names: Vec<(&str, &str)> = series.iter().map(|se| (se.name, se.color)).collect();
        legend(s, &names);
    }
}

/// A percentile spectrum: x = log10(1 / (1 - p)), so 90%, 99%, 99.9% are evenly spaced.
/// `sorted_ns` is sorted latencies in nanoseconds; points are in milliseconds.
pub fn percentile_curve(sorted_ns: &[u64], max_nines: f64) -> Vec<(f64, f64)> {
    let steps = 200;
    (0..=steps)
        .map(|i| {
            let x = max_nines * i as f64 / steps as f64;
            let p = 1.0 - 10f64.powf(-x);
            let v = crate::load::percentile(sorted_ns, p.max(0.0));
            (x, v as f64 / 1e6)
        })
        .collect()
}

/// Ticks for [`percentile_curve`]'s axis up to `max_nines`.
pub fn percentile_ticks(max_nines: f64) -> Vec<(f64, String)> {
    [
        (0.0, "0%"),
        (std::f64::consts::LOG10_2, "50%"),
        (1.0, "90%"),
        (2.0, "99%"),
        (3.0, "99.9%"),
        (4.0, "99.99%"),
        (5.0, "99.999%"),
    ]
    .iter()
    .filter(|(x, _)| *x <= max_nines + 1e-9)
    .map(|(x, l)| (*x, l.to_string()))
    .collect()
}
