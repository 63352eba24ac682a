//! Layered configuration, the same for every binary: defaults < TOML file
//! (`--config`) < environment (`<PREFIX>_<KEY>`) < command-line flags.
//!
//! A binary declares its settings once, as a `Serialize + Deserialize +
//! Default` struct with `#[serde(default, deny_unknown_fields)]`, and its flags
//! as a clap struct whose fields are `Option`s skipped when `None`, so only
//! flags actually given override the lower layers. [`load`] does the rest.
//!
//! The environment layer knows the settings' keys from the defaults:
//! - a key that is not a setting is an error naming the variable (a typo
//!   must not be ignored), except the Service-link variables Kubernetes
//!   injects for every Service in the namespace (`<SERVICE>_SERVICE_HOST`,
//!   `<SERVICE>_PORT_8090_TCP`, …): a Service named `proxy-server` makes
//!   `PROXY_SERVER_SERVICE_HOST` appear in every pod, and those are skipped;
//! - boolean settings accept Go's spellings (`1`, `t`, `True`, …) as upstream
//!   manifests write them.

use std::collections::BTreeMap;
use std::path::Path;

use figment::providers::{Format, Serialized, Toml};
use figment::value::{Dict, Empty, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration: {0}")]
    Figment(#[from] Box<figment::Error>),
    #[error("invalid --{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("configuration: the defaults of {0} do not serialize to a table of settings")]
    Defaults(&'static str),
}

/// A value that parses but cannot work, named by its flag.
pub fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// The IP address a `--*-bind-address` flag names; empty is every IPv4
/// address, as upstream's empty bind addresses mean.
pub fn bind_ip(field: &'static str, value: &str) -> Result<std::net::IpAddr, ConfigError> {
    if value.is_empty() {
        return Ok(std::net::IpAddr::from([0, 0, 0, 0]));
    }
    value
        .parse()
        .map_err(|_| invalid(field, format!("{value:?} is not an IP address")))
}

/// `--host-alias` values (`NAME=IP`, like a pod's hostAliases): NAME
/// resolves to IP before DNS is asked.
pub fn host_aliases(
    values: &[String],
) -> Result<std::collections::HashMap<String, std::net::IpAddr>, ConfigError> {
    let mut aliases = std::collections::HashMap::new();
    for alias in values {
        let parsed = alias
            .split_once('=')
            .and_then(|(name, ip)| Some((name.trim(), ip.trim().parse::<std::net::IpAddr>().ok()?)))
            .filter(|(name, _)| !name.is_empty());
        let Some((name, ip)) = parsed else {
            return Err(invalid("host-alias", format!("{alias:?} is not NAME=IP")));
        };
        aliases.insert(name.to_owned(), ip);
    }
    Ok(aliases)
}

/// Where a binary's environment layer reads from.
#[derive(Debug, Clone, Copy)]
pub struct EnvSpec {
    /// Variable prefix including the trailing underscore, e.g. `PROXY_SERVER_`.
    pub prefix: &'static str,
    /// Variables (without the prefix) that name another key, e.g. upstream's
    /// `PROXY_SERVER_ID` for `server_id`: `("ID", "server_id")`.
    pub aliases: &'static [(&'static str, &'static str)],
}

/// Layers `T::default()`, the TOML `file`, the process environment and the
/// `flags`, then deserializes `T`.
pub fn load<T>(spec: EnvSpec, file: Option<&Path>, flags: &impl Serialize) -> Result<T, ConfigError>
where
    T: Serialize + DeserializeOwned + Default,
{
    load_with_env(spec, file, flags, std::env::vars())
}

/// [`load`] with an explicit environment (tests).
pub fn load_with_env<T>(
    spec: EnvSpec,
    file: Option<&Path>,
    flags: &impl Serialize,
    vars: impl IntoIterator<Item = (String, String)>,
) -> Result<T, ConfigError>
where
    T: Serialize + DeserializeOwned + Default,
{
    let defaults = T::default();
    let keys = setting_kinds(&defaults)?;
    let mut figment = Figment::from(Serialized::defaults(&defaults));
    if let Some(path) = file {
        if !path.is_file() {
            return Err(invalid(
                "config",
                format!("{} does not exist or is not a file", path.display()),
            ));
        }
        figment = figment.merge(Toml::file(path));
    }
    let environment = EnvLayer::new(spec, &keys, vars);
    let config = figment
        .merge(environment)
        .merge(FlagLayer::new(flags)?)
        .extract()
        .map_err(Box::new)?;
    Ok(config)
}

/// The flags that were given, named as typed (`--leaf-validity`) in errors.
///
/// Flags are `Option`s; one not given serializes as `None` and is left out
/// here, so that it overrides nothing (and the flag structs need no
/// `skip_serializing_if` on each field).
struct FlagLayer {
    values: Dict,
}

impl FlagLayer {
    fn new(flags: &impl Serialize) -> Result<Self, ConfigError> {
        match Value::serialize(flags).map_err(Box::new)? {
            Value::Dict(_, mut values) => {
                values.retain(|_, value| !matches!(value, Value::Empty(_, Empty::None)));
                Ok(FlagLayer { values })
            }
            _ => Err(ConfigError::Defaults("the command-line flags")),
        }
    }
}

impl Provider for FlagLayer {
    fn metadata(&self) -> Metadata {
        Metadata::named("command-line flag")
            .interpolater(|_, keys| format!("--{}", keys.join(".").replace('_', "-")))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.values.clone()))
    }
}

/// Whether a setting is a boolean (parsed with Go's spellings) or anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Other,
}

fn setting_kinds<T: Serialize>(defaults: &T) -> Result<BTreeMap<String, Kind>, ConfigError> {
    let serde_json::Value::Object(fields) = serde_json::to_value(defaults)
        .map_err(|_| ConfigError::Defaults(std::any::type_name::<T>()))?
    else {
        return Err(ConfigError::Defaults(std::any::type_name::<T>()));
    };
    Ok(fields
        .into_iter()
        .map(|(key, value)| {
            let kind = if value.is_boolean() {
                Kind::Bool
            } else {
                Kind::Other
            };
            (key, kind)
        })
        .collect())
}

/// Whether a variable (without the binary's prefix) and its value are one of
/// the Service-link variables Kubernetes injects for a Service whose name
/// starts like the binary: `SERVICE_HOST`, `SERVICE_PORT`, `SERVICE_PORT_<NAME>`,
/// `PORT_<N>_<PROTO>`, `PORT_<N>_<PROTO>_{PROTO,PORT,ADDR}`, each possibly
/// after the rest of a longer Service name (`METRICS_SERVICE_HOST`), and the
/// bare `<NAME>_PORT` whose value is `tcp://IP:PORT` (a Service named
/// `proxy-server-agent` injects `PROXY_SERVER_AGENT_PORT=tcp://…`).
pub fn is_service_link(rest: &str, value: &str) -> bool {
    let upper = rest.to_ascii_uppercase();
    let tokens: Vec<&str> = upper.split('_').collect();
    let url_value = ["tcp://", "udp://", "sctp://"]
        .iter()
        .any(|scheme| value.starts_with(scheme));
    tokens.iter().enumerate().any(|(i, token)| match *token {
        "SERVICE" => matches!(tokens.get(i + 1), Some(&"HOST") | Some(&"PORT")),
        "PORT" => {
            let tail = &tokens[i + 1..];
            (tail.is_empty() && url_value)
                || (tail.len() >= 2
                    && tail[0].chars().all(|c| c.is_ascii_digit())
                    && matches!(tail[1], "TCP" | "UDP" | "SCTP")
                    && (tail.len() == 2
                        || (tail.len() == 3 && matches!(tail[2], "PROTO" | "PORT" | "ADDR"))))
        }
        _ => false,
    })
}

/// The environment as a figment provider (see the module docs).
struct EnvLayer {
    prefix: &'static str,
    values: Dict,
}

impl EnvLayer {
    fn new(
        spec: EnvSpec,
        keys: &BTreeMap<String, Kind>,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Self {
        let mut values = Dict::new();
        for (name, raw) in vars {
            let Some(rest) = strip_prefix_ignore_case(&name, spec.prefix) else {
                continue;
            };
            let key = spec
                .aliases
                .iter()
                .find(|(alias, _)| alias.eq_ignore_ascii_case(rest))
                .map(|(_, key)| (*key).to_owned())
                .unwrap_or_else(|| rest.to_ascii_lowercase());
            if is_service_link(rest, &raw) {
                continue;
            }
            let value = match keys.get(&key) {
                Some(Kind::Bool) => match cluster_proxy_proto::strconv::parse_bool(&raw) {
                    Some(b) => Value::from(b),
                    // Left as text so the error names the variable and the value.
                    None => Value::from(raw),
                },
                Some(Kind::Other) => raw.parse().unwrap_or_else(|e| match e {}),
                // Unknown: passed on, so `deny_unknown_fields` names it.
                None => Value::from(raw),
            };
            values.insert(key, value);
        }
        EnvLayer {
            prefix: spec.prefix,
            values,
        }
    }
}

fn strip_prefix_ignore_case<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let head = name.get(..prefix.len())?;
    let rest = &name[prefix.len()..];
    (head.eq_ignore_ascii_case(prefix) && !rest.is_empty()).then_some(rest)
}

impl Provider for EnvLayer {
    fn metadata(&self) -> Metadata {
        let prefix = self.prefix;
        Metadata::named("environment variable")
            .interpolater(move |_, keys| format!("{prefix}{}", keys.join("_").to_ascii_uppercase()))
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.values.clone()))
    }
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Settings {
        port: u16,
        server_id: String,
        sync_forever: bool,
        names: Vec<String>,
    }

    impl Default for Settings {
        fn default() -> Self {
            Settings {
                port: 1,
                server_id: String::new(),
                sync_forever: false,
                names: Vec::new(),
            }
        }
    }

    #[derive(Serialize, Default)]
    struct Flags {
        port: Option<u16>,
        sync_forever: Option<String>,
    }

    const SPEC: EnvSpec = EnvSpec {
        prefix: "TEST_",
        aliases: &[("ID", "server_id")],
    };

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn layers_defaults_file_environment_flags_in_order() {
        figment::Jail::expect_with(|jail| {
            jail.create_file("c.toml", "port = 10\nserver_id = \"file\"\n")?;
            let from_file: Settings =
                load_with_env(SPEC, Some(Path::new("c.toml")), &Flags::default(), env(&[]))
                    .map_err(|e| e.to_string())?;
            assert_eq!((from_file.port, from_file.server_id.as_str()), (10, "file"));
            let from_env: Settings = load_with_env(
                SPEC,
                Some(Path::new("c.toml")),
                &Flags::default(),
                env(&[("TEST_PORT", "20"), ("TEST_ID", "env")]),
            )
            .map_err(|e| e.to_string())?;
            assert_eq!((from_env.port, from_env.server_id.as_str()), (20, "env"));
            let from_flag: Settings = load_with_env(
                SPEC,
                Some(Path::new("c.toml")),
                &Flags {
                    port: Some(30),
                    ..Flags::default()
                },
                env(&[("TEST_PORT", "20")]),
            )
            .map_err(|e| e.to_string())?;
            assert_eq!(from_flag.port, 30);
            Ok(())
        });
    }

    #[test]
    fn go_booleans_and_lists_from_the_environment() {
        let s: Settings = load_with_env(
            SPEC,
            None,
            &Flags::default(),
            env(&[("TEST_SYNC_FOREVER", "True"), ("TEST_NAMES", "[a, b]")]),
        )
        .unwrap();
        assert!(s.sync_forever);
        assert_eq!(s.names, ["a", "b"]);
        let err = load_with_env::<Settings>(
            SPEC,
            None,
            &Flags::default(),
            env(&[("TEST_SYNC_FOREVER", "yes")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("TEST_SYNC_FOREVER"), "{err}");
    }

    #[test]
    fn service_links_are_skipped_and_typos_named() {
        let s: Settings = load_with_env(
            SPEC,
            None,
            &Flags::default(),
            env(&[
                ("TEST_SERVICE_HOST", "10.0.0.1"),
                ("TEST_SERVICE_PORT", "8090"),
                ("TEST_SERVICE_PORT_GRPC", "8090"),
                ("TEST_PORT_8090_TCP", "tcp://10.0.0.1:8090"),
                ("TEST_PORT_8090_TCP_ADDR", "10.0.0.1"),
                ("TEST_PORT", "tcp://10.0.0.1:8090"),
                ("TEST_METRICS_SERVICE_HOST", "10.0.0.2"),
                ("OTHER_PORT", "9"),
            ]),
        )
        .unwrap();
        assert_eq!(s, Settings::default());
        let err =
            load_with_env::<Settings>(SPEC, None, &Flags::default(), env(&[("TEST_PROT", "5")]))
                .unwrap_err()
                .to_string();
        assert!(err.contains("prot"), "{err}");
    }

    #[test]
    fn bad_values_name_their_source() {
        let err =
            load_with_env::<Settings>(SPEC, None, &Flags::default(), env(&[("TEST_PORT", "many")]))
                .unwrap_err()
                .to_string();
        assert!(err.contains("TEST_PORT"), "{err}");
        let flag = Flags {
            sync_forever: Some("maybe".into()),
            ..Flags::default()
        };
        let err = load_with_env::<Settings>(SPEC, None, &flag, env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--sync-forever"), "{err}");
        let err = load_with_env::<Settings>(
            SPEC,
            Some(Path::new("/nonexistent.toml")),
            &Flags::default(),
            env(&[]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--config") && err.contains("/nonexistent.toml"),
            "{err}"
        );
    }

    #[test]
    fn service_link_pattern() {
        for (yes, value) in [
            ("SERVICE_HOST", "10.0.0.1"),
            ("SERVICE_PORT", "8090"),
            ("SERVICE_PORT_HTTPS", "443"),
            ("PORT", "tcp://10.0.0.1:443"),
            ("AGENT_PORT", "tcp://10.0.0.1:8091"),
            ("PORT_443_TCP", "tcp://10.0.0.1:443"),
            ("PORT_443_TCP_PROTO", "tcp"),
            ("ENTRYPOINT_SERVICE_HOST", "10.0.0.1"),
            ("ENTRYPOINT_PORT_8091_TCP_PORT", "8091"),
        ] {
            assert!(is_service_link(yes, value), "{yes}={value}");
        }
        for (no, value) in [
            ("SERVER_PORT", "8090"),
            ("AGENT_PORT", "8091"),
            ("PORT_X_TCP", "1"),
            ("HEALTH_PORT", "8092"),
            ("ID", "a"),
        ] {
            assert!(!is_service_link(no, value), "{no}={value}");
        }
    }
}
