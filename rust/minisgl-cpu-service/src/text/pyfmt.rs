//! Python formatting the chat templates see through transformers: `json.dumps` (its `tojson`
//! filter) and `datetime.now().strftime` (its `strftime_now` global).

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// `json.dumps` options (transformers' `tojson` defaults: `ensure_ascii=False`).
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// None: one line; Some(s): one item per line, indented by `s` per level.
    pub indent: Option<String>,
    /// (item separator, key separator); None: Python's default for the indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

fn not_serializable(what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        format!("Object of type {what} is not JSON serializable"),
    )
}

/// Python `json.dumps(value, ...)` of a template value.
pub fn dumps(value: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((a, b)) => (a.clone(), b.clone()),
        None if opts.indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let mut w = Dumper {
        out: String::new(),
        opts,
        item_sep,
        key_sep,
        depth: 0,
    };
    w.value(value)?;
    Ok(w.out)
}

struct Dumper<'a> {
    out: String,
    opts: &'a DumpOptions,
    item_sep: String,
    key_sep: String,
    depth: usize,
}

impl Dumper<'_> {
    fn newline(&mut self) {
        if let Some(ind) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..self.depth {
                self.out.push_str(ind);
            }
        }
    }

    fn sep(&mut self, first: bool) {
        if !first {
            let sep = self.item_sep.clone();
            self.out.push_str(&sep);
        }
        self.newline();
    }

    fn value(&mut self, v: &Value) -> Result<(), Error> {
        match v.kind() {
            ValueKind::Undefined => return Err(not_serializable("Undefined")),
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&number(v)?),
            ValueKind::String => write_str(&mut self.out, v.as_str().unwrap_or(""), self.opts),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    self.out.push_str("[]");
                    return Ok(());
                }
                self.out.push('[');
                self.depth += 1;
                for (i, item) in items.iter().enumerate() {
                    self.sep(i == 0);
                    self.value(item)?;
                }
                self.depth -= 1;
                self.newline();
                self.out.push(']');
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for k in v.try_iter()? {
                    let item = v.get_item(&k)?;
                    entries.push((key_string(&k)?, item));
                }
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                if entries.is_empty() {
                    self.out.push_str("{}");
                    return Ok(());
                }
                self.out.push('{');
                self.depth += 1;
                for (i, (k, item)) in entries.iter().enumerate() {
                    self.sep(i == 0);
                    write_str(&mut self.out, k, self.opts);
                    let ks = self.key_sep.clone();
                    self.out.push_str(&ks);
                    self.value(item)?;
                }
                self.depth -= 1;
                self.newline();
                self.out.push('}');
            }
            other => return Err(not_serializable(&other.to_string())),
        }
        Ok(())
    }
}

/// JSON object keys as Python converts them (str, int, float, bool, None).
fn key_string(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or("").to_owned()),
        ValueKind::Number => number(k),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        other => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("keys must be str, int, float, bool or None, not {other}"),
        )),
    }
}

fn number(v: &Value) -> Result<String, Error> {
    if v.is_integer() {
        return Ok(v.to_string());
    }
    let f = f64::try_from(v.clone())?;
    Ok(float_json(f))
}

/// Python's `float.__repr__` (shortest round-trip digits; scientific below 1e-4 and from
/// 1e16), with JSON's names for the non-finite values.
pub fn float_json(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    let sci = format!("{f:e}"); // e.g. "-1.25e-7", "1e16"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::new();
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        if exp >= 0 {
            let int_len = (exp + 1) as usize;
            if n <= exp + 1 {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    out
}

fn write_str(out: &mut String, s: &str, opts: &DumpOptions) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if opts.ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Days since 1970-01-01 of a civil date (month 1-12).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Civil date (year, month 1-12, day 1-31) of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `strftime(format)` of a UTC time in seconds since the epoch (the C locale's names).
/// Codes: a A b B d e H I j m M p S y Y %, and the glibc `%-d` form without padding;
/// an unknown code is written as is.
pub fn strftime(format: &str, secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (tod / 3600, (tod / 60) % 60, tod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let jan1 = days_from_civil(y, 1, 1);
    let yday = days - jan1 + 1;
    let h12 = if hh % 12 == 0 { 12 } else { hh % 12 };
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.peek() == Some(&'-');
        if unpadded {
            chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if unpadded {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match chars.next() {
            Some('Y') => {
                let _ = write!(out, "{y}");
            }
            Some('y') => num(&mut out, y.rem_euclid(100), 2),
            Some('m') => num(&mut out, i64::from(m), 2),
            Some('d') => num(&mut out, i64::from(d), 2),
            Some('e') => {
                let _ = write!(out, "{d:>2}");
            }
            Some('H') => num(&mut out, hh, 2),
            Some('I') => num(&mut out, h12, 2),
            Some('M') => num(&mut out, mm, 2),
            Some('S') => num(&mut out, ss, 2),
            Some('j') => num(&mut out, yday, 3),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `strftime_now(format)`: the current time (UTC) formatted.
pub fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    strftime(format, secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e100, "1e+100"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(float_json(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_matches_python_json() {
        let json = r#"{"b": [1, 2.5, "é\"\n", null, true], "a": {}}"#;
        let v = crate::text::chat::json_to_value(&serde_json::from_str(json).expect("json"));
        let d = DumpOptions::default();
        assert_eq!(
            dumps(&v, &d).expect("dumps"),
            r#"{"b": [1, 2.5, "é\"\n", null, true], "a": {}}"#
        );
        let d = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            sort_keys: true,
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &d).expect("dumps"),
            "{\n  \"a\": {},\n  \"b\": [\n    1,\n    2.5,\n    \"\\u00e9\\\"\\n\",\n    null,\n    true\n  ]\n}"
        );
        assert!(dumps(&Value::UNDEFINED, &d).is_err());
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday
        let t = 1_709_211_909;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %j %I %p %y %-d %e %%", t),
            "2024-02-29 13:05:09 Thu Thursday Feb February 060 01 PM 24 29 29 %"
        );
        assert_eq!(strftime("%d %b %Y", 0), "01 Jan 1970");
    }
}
