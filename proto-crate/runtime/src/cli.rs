//! Command lines that document themselves.
//!
//! Flags are `Option`s so that only flags actually given override the file
//! and the environment ([`crate::config`]); clap therefore cannot know their
//! defaults. [`parse`] copies each default from the settings' `Default` into
//! the flag's help, so `--help` shows the value the binary really uses and
//! cannot drift from it.

use clap::{Command, CommandFactory, FromArgMatches};
use serde::Serialize;

/// Parses the process arguments into `C`, with every flag's help showing the
/// default taken from `defaults` (a struct whose field names are the flags'
/// ids). On `--help`, `--version` or an error, prints and exits as clap does.
pub fn parse<C: CommandFactory + FromArgMatches>(defaults: &impl Serialize) -> C {
    parse_from(defaults, std::env::args_os())
}

/// [`parse`] over explicit arguments (tests).
pub fn parse_from<C, I, T>(defaults: &impl Serialize, args: I) -> C
where
    C: CommandFactory + FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    parse_command_from(command::<C>(defaults), args)
}

/// Parses the process arguments with a prepared `cmd` (for example one whose
/// subcommands got their own defaults through [`with_subcommand_defaults`]).
pub fn parse_command<C: FromArgMatches>(cmd: Command) -> C {
    parse_command_from(cmd, std::env::args_os())
}

fn parse_command_from<C, I, T>(cmd: Command, args: I) -> C
where
    C: FromArgMatches,
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = cmd.get_matches_from(args);
    C::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// [`with_defaults`] for the subcommand `name` of `cmd`.
pub fn with_subcommand_defaults(cmd: Command, name: &str, defaults: &impl Serialize) -> Command {
    cmd.mut_subcommand(name, |sub| with_defaults(sub, defaults))
}

/// `C`'s command with the defaults of `defaults` appended to each flag's help.
pub fn command<C: CommandFactory>(defaults: &impl Serialize) -> Command {
    with_defaults(C::command(), defaults)
}

/// Appends `[default: V]` to the help of every argument of `cmd` whose id is
/// a field of `defaults` with a non-empty value.
pub fn with_defaults(mut cmd: Command, defaults: &impl Serialize) -> Command {
    let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(defaults) else {
        return cmd;
    };
    let ids: Vec<String> = cmd
        .get_arguments()
        .map(|arg| arg.get_id().to_string())
        .collect();
    for id in ids {
        let Some(shown) = fields.get(&id).and_then(display_default) else {
            continue;
        };
        cmd = cmd.mut_arg(&id, |arg| {
            let shown = format!("[default: {shown}]");
            match arg.get_help().map(|h| h.to_string()) {
                Some(help) if !help.is_empty() => arg.help(format!("{help} {shown}")),
                _ => arg.help(shown),
            }
        });
    }
    cmd
}

fn display_default(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::Null => None,
        serde_json::Value::String(s) if s.is_empty() => None,
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(items) if items.is_empty() => None,
        serde_json::Value::Array(items) => Some(
            items
                .iter()
                .filter_map(display_default)
                .collect::<Vec<_>>()
                .join(","),
        ),
        other => Some(other.to_string()),
    }
}

/// What is wrong with `C`'s `--help`: every visible flag without a
/// description, and every `expected` text (such as `[default: 8090]`) that
/// the help with `defaults` does not show. Every binary tests that this is empty.
pub fn help_problems<C: CommandFactory>(
    defaults: &impl Serialize,
    expected: &[&str],
) -> Vec<String> {
    let mut problems: Vec<String> = undocumented_flags(&C::command())
        .into_iter()
        .map(|flag| format!("{flag} has no description"))
        .collect();
    let help = command::<C>(defaults).render_long_help().to_string();
    problems.extend(
        expected
            .iter()
            .filter(|text| !help.contains(*text))
            .map(|text| format!("{text} is not shown")),
    );
    problems
}

/// The visible flags of `cmd` and its subcommands that have no description:
/// each is `command --flag`. Every binary tests that this is empty.
pub fn undocumented_flags(cmd: &Command) -> Vec<String> {
    let mut missing = Vec::new();
    collect_undocumented(cmd, cmd.get_name(), &mut missing);
    missing
}

fn collect_undocumented(cmd: &Command, path: &str, missing: &mut Vec<String>) {
    for arg in cmd.get_arguments() {
        let builtin = matches!(arg.get_id().as_str(), "help" | "version");
        let described = arg
            .get_help()
            .is_some_and(|h| !h.to_string().trim().is_empty());
        if !arg.is_hide_set() && !builtin && !described {
            let name = arg
                .get_long()
                .map(|l| format!("--{l}"))
                .unwrap_or_else(|| arg.get_id().to_string());
            missing.push(format!("{path} {name}"));
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() == "help" {
            continue;
        }
        collect_undocumented(sub, &format!("{path} {}", sub.get_name()), missing);
    }
}

/// Go's `strconv.ParseBool`, which pflag applies to `--flag=value`: a clap
/// `value_parser` for boolean flags (`num_args = 0..=1`,
/// `default_missing_value = "true"`), so `--flag`, `--flag=True` and
/// `--flag=0` all work as they do upstream.
pub fn parse_go_bool(value: &str) -> Result<bool, String> {
    cluster_proxy_proto::strconv::parse_bool(value).ok_or_else(|| {
        format!("invalid boolean {value:?} (use one of 1, t, T, TRUE, true, True, 0, f, F, FALSE, false, False)")
    })
}

/// The clap `value_parser` of a path flag that, like pflag, takes an empty
/// value (`--server-cert=`, as upstream's tooling renders an unset path);
/// the settings treat an empty path as not given.
pub fn parse_path(value: &str) -> Result<std::path::PathBuf, String> {
    Ok(std::path::PathBuf::from(value))
}

/// One occurrence of a pflag string-slice flag, in every form upstream's
/// tooling renders one: `a,b`, `[a,b]` (pflag's own rendering of a value,
/// which upstream's test harness passes back), `[]` and the empty string
/// (both an empty list). Empty elements are dropped. Occurrences append, as
/// pflag's do; [`serialize_go_lists`] flattens them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GoList(pub Vec<String>);

/// The clap `value_parser` of a [`GoList`] flag.
pub fn parse_go_list(value: &str) -> Result<GoList, String> {
    let inner = value
        .strip_prefix('[')
        .and_then(|rest| rest.strip_suffix(']'))
        .unwrap_or(value);
    if inner.contains(['[', ']']) {
        return Err(format!("invalid list {value:?}: expected a,b or [a,b]"));
    }
    Ok(GoList(
        inner
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(str::to_owned)
            .collect(),
    ))
}

/// Serializes the occurrences of a [`GoList`] flag as one list, for
/// `#[serde(serialize_with = "...")]` on an `Option<Vec<GoList>>` field;
/// a flag not given stays `None`, which the flag layer leaves out.
pub fn serialize_go_lists<S: serde::Serializer>(
    lists: &Option<Vec<GoList>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let Some(lists) = lists else {
        return serializer.serialize_none();
    };
    serializer.collect_seq(lists.iter().flat_map(|list| list.0.iter()))
}

/// The health port's flags, flattened into the command line of every binary
/// that serves `/healthz` and `/readyz` (and `/metrics`, where it has metrics).
#[derive(Debug, Default, Clone, clap::Args, Serialize)]
pub struct HealthFlags {
    /// Port of /healthz and /readyz, and of /metrics where the binary has metrics (0: any free port).
    #[arg(long)]
    pub health_port: Option<u16>,
    /// Address the health port listens on (empty: every address).
    #[arg(long)]
    pub health_bind_address: Option<String>,
}

/// The leader-election flag of a control-plane binary whose replicas must
/// not act at once.
#[derive(Debug, Default, Clone, clap::Args, Serialize)]
pub struct LeaderElectionFlags {
    /// Elect a leader on the Lease `cluster-proxy-<binary>` so that of
    /// several replicas exactly one acts.
    #[arg(long, value_parser = parse_go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: Option<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    #[command(name = "demo")]
    struct Demo {
        /// Port to listen on.
        #[arg(long)]
        port: Option<u16>,
        /// Names to serve.
        #[arg(long)]
        names: Option<Vec<String>>,
        #[arg(long)]
        quiet: Option<bool>,
        /// Hidden ones need no text.
        #[arg(long, hide = true)]
        legacy: Option<bool>,
    }

    #[derive(Serialize)]
    struct Defaults {
        port: u16,
        names: Vec<String>,
        quiet: bool,
        unrelated: &'static str,
    }

    const DEFAULTS: Defaults = Defaults {
        port: 8090,
        names: Vec::new(),
        quiet: false,
        unrelated: "x",
    };

    #[test]
    fn help_shows_the_real_defaults() {
        let cmd = command::<Demo>(&DEFAULTS);
        let help = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default()
        };
        // clap drops a one-line doc comment's final period.
        assert_eq!(help("port"), "Port to listen on [default: 8090]");
        assert_eq!(help("names"), "Names to serve");
        assert_eq!(help("quiet"), "[default: false]");
    }

    #[test]
    fn flags_without_a_description_are_listed() {
        assert_eq!(undocumented_flags(&Demo::command()), ["demo --quiet"]);
        assert_eq!(
            help_problems::<Demo>(&DEFAULTS, &["[default: 8090]", "[default: 9]"]),
            [
                "demo --quiet has no description",
                "[default: 9] is not shown"
            ]
        );
        let parsed: Demo = parse_from(&DEFAULTS, ["demo", "--port", "1"]);
        assert_eq!(parsed.port, Some(1));
    }

    #[test]
    fn go_lists_in_every_rendered_form() {
        let list = |v: &str| parse_go_list(v).map(|l| l.0);
        assert_eq!(list("").unwrap(), Vec::<String>::new());
        assert_eq!(list("[]").unwrap(), Vec::<String>::new());
        assert_eq!(list("a").unwrap(), ["a"]);
        assert_eq!(list("a,b").unwrap(), ["a", "b"]);
        assert_eq!(list("[a,b]").unwrap(), ["a", "b"]);
        assert_eq!(list("a,,b").unwrap(), ["a", "b"]);
        assert!(list("[a").is_err());
        assert!(list("a]").is_err());
        assert!(list("[[a]]").is_err());

        #[derive(Parser, Serialize)]
        struct Lists {
            /// A list.
            #[arg(long, value_parser = parse_go_list)]
            #[serde(serialize_with = "serialize_go_lists")]
            items: Option<Vec<GoList>>,
        }
        let parsed = Lists::try_parse_from(["x", "--items=[a,b]", "--items", "c"]).unwrap();
        assert_eq!(
            serde_json::to_value(&parsed).unwrap(),
            serde_json::json!({"items": ["a", "b", "c"]})
        );
        let empty = Lists::try_parse_from(["x", "--items=[]"]).unwrap();
        assert_eq!(
            serde_json::to_value(&empty).unwrap(),
            serde_json::json!({"items": []})
        );
        let none = Lists::try_parse_from(["x"]).unwrap();
        assert_eq!(
            serde_json::to_value(&none).unwrap(),
            serde_json::json!({"items": null})
        );
    }

    #[test]
    fn go_booleans() {
        assert_eq!(parse_go_bool("True"), Ok(true));
        assert_eq!(parse_go_bool("0"), Ok(false));
        let err = parse_go_bool("yes").unwrap_err();
        assert!(err.contains("yes"), "{err}");
    }
}
