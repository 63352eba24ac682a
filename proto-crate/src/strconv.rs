//! Go's `strconv.ParseBool`, the boolean syntax of every upstream flag
//! (pflag), of environment values in upstream manifests and of the
//! `agentidentifiers` query. No maintained crate implements Go's exact set.

/// `1 t T TRUE true True` and `0 f F FALSE false False`; anything else is `None`.
pub fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_bool;

    #[test]
    fn accepts_exactly_gos_spellings() {
        for yes in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_bool(yes), Some(true), "{yes}");
        }
        for no in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_bool(no), Some(false), "{no}");
        }
        for bad in ["", "yes", "tRUE", "on", " true", "2"] {
            assert_eq!(parse_bool(bad), None, "{bad:?}");
        }
    }
}
