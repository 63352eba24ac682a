//! Go-style durations (`1h0m0s`, `1.5s`, `300ms`), as upstream flags print and
//! accept them, so existing manifests keep working.

use std::time::Duration;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid duration {0:?}: expected a Go duration such as 30s, 1m30s, 1h0m0s or 250ms")]
pub struct DurationError(pub String);

/// Parses a non-negative Go duration string.
pub fn parse_go_duration(input: &str) -> Result<Duration, DurationError> {
    let err = || DurationError(input.to_owned());
    let s = input.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() || s.starts_with('-') {
        return Err(err());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        let (num, tail) = rest.split_at(num_len);
        if num.is_empty() || num == "." {
            return Err(err());
        }
        let value: f64 = num.parse().map_err(|_| err())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(err()),
        };
        total += value * scale;
        rest = next;
    }
    Duration::try_from_secs_f64(total).map_err(|_| err())
}

/// Formats a duration the way Go prints it for the common cases (`1h0m0s`, `30s`, `250ms`).
pub fn format_go_duration(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d < Duration::from_secs(1) {
        let ms = d.as_secs_f64() * 1e3;
        return if ms.fract() == 0.0 {
            format!("{ms}ms")
        } else {
            format!("{}µs", d.as_micros())
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs % 3600) / 60, secs % 60);
    let frac = d.subsec_nanos();
    let s_str = if frac == 0 {
        format!("{s}")
    } else {
        let f = format!("{:.9}", f64::from(frac) / 1e9);
        format!("{s}{}", f.trim_start_matches('0').trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => format!("{s_str}s"),
        (0, m) => format!("{m}m{s_str}s"),
        (h, m) => format!("{h}h{m}m{s_str}s"),
    }
}

/// serde adapter: `#[serde(with = "cluster_proxy_proto::duration::serde_go")]`.
pub mod serde_go {
    use std::time::Duration;

    pub fn serialize<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_go_duration(*d))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Duration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a Go duration string such as \"30s\" or a number of seconds")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Duration, E> {
                super::parse_go_duration(v).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Duration, E> {
                Ok(Duration::from_secs(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Duration, E> {
                u64::try_from(v)
                    .map(Duration::from_secs)
                    .map_err(|_| E::custom("a duration cannot be negative"))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Duration, E> {
                Duration::try_from_secs_f64(v).map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse_go_duration("1h0m0s"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_go_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_go_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "10", "-1s", "1x", "s", ".s", "1h-2m"] {
            assert!(parse_go_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn formats_like_go() {
        assert_eq!(format_go_duration(Duration::from_secs(3600)), "1h0m0s");
        assert_eq!(format_go_duration(Duration::from_secs(10)), "10s");
        assert_eq!(format_go_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(format_go_duration(Duration::ZERO), "0s");
        for d in [3600, 90, 1, 86400] {
            let d = Duration::from_secs(d);
            assert_eq!(parse_go_duration(&format_go_duration(d)), Ok(d));
        }
    }
}
