//! OIDC ID tokens as hub credentials (`--oidc-issuer-url`): a bearer token
//! whose `iss` is the configured issuer is verified here, against the
//! issuer's published keys, instead of by the hub's TokenReview. The claims
//! are mapped to a user as kube-apiserver's OIDC authenticator maps them
//! (upstream's flags and defaults), and the hub's RBAC then decides as for
//! any other user.
//!
//! The keys come from the issuer's discovery document (`jwks_uri`); a token
//! signed by a key not seen yet makes one fetch of the key set (at most one
//! every [`REFRESH_AT_MOST_EVERY`] by default), so a rotated key is picked up without a
//! restart and a stream of forged key ids cannot make the user-server hammer
//! the issuer.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use cluster_proxy_runtime::http_proxy::{Schemes, pooled_client};
use cluster_proxy_runtime::tls::{self, Pem, TlsError};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

use crate::authn::{AuthnError, User};

/// A key set is fetched again for an unknown key id at most this often
/// (by default: [`OidcConfig::keys_refresh_interval`]).
pub const REFRESH_AT_MOST_EVERY: Duration = Duration::from_secs(10);
/// How long the issuer has to answer a fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Clock skew tolerated on `exp`, `nbf` and `iat`.
const LEEWAY_SECONDS: u64 = 60;
/// Names a token may not claim (kube-apiserver's reserved prefix).
const RESERVED_PREFIX: &str = "system:";

/// The OIDC settings, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct OidcConfig {
    /// The `iss` tokens carry, an https URL (no trailing slash added).
    pub issuer: String,
    /// The audience tokens must carry.
    pub client_id: String,
    pub username_claim: String,
    /// Prepended to the user name.
    pub username_prefix: String,
    /// The claim holding the groups (a string or a list), if any.
    pub groups_claim: Option<String>,
    pub groups_prefix: String,
    /// CA bundle of the issuer's serving certificate; none: the system's.
    pub ca_file: Option<PathBuf>,
    pub signing_algs: Vec<Algorithm>,
    /// Claims that must be present with these values.
    pub required_claims: Vec<(String, String)>,
    /// The least time between two fetches of the key set.
    pub keys_refresh_interval: Duration,
}

impl OidcConfig {
    /// kube-apiserver's default user name prefix: the issuer and `#`,
    /// except for the `email` claim, which is used as it is.
    pub fn default_username_prefix(issuer: &str, username_claim: &str) -> String {
        if username_claim == "email" {
            String::new()
        } else {
            format!("{issuer}#")
        }
    }
}

/// Why the issuer's keys could not be had.
#[derive(Debug, thiserror::Error)]
pub enum OidcError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("no CA to verify the OIDC issuer with: none in the system's store; set --oidc-ca-file")]
    NoRoots,
}

type Fetcher = Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>;

struct Keys {
    set: Arc<JwkSet>,
    fetched: Option<Instant>,
}

/// Verifies ID tokens of one issuer.
pub struct OidcAuthenticator {
    config: OidcConfig,
    fetcher: Fetcher,
    keys: RwLock<Keys>,
    /// One fetch at a time; the others wait for its result.
    fetching: tokio::sync::Mutex<()>,
}

impl OidcAuthenticator {
    pub fn new(config: OidcConfig) -> Result<Self, OidcError> {
        let roots = match &config.ca_file {
            Some(path) => tls::roots(&Pem::file("OIDC issuer CA", path)?)?,
            None => {
                let found = rustls_native_certs::load_native_certs();
                let mut store = rustls::RootCertStore::empty();
                let (added, _) = store.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(OidcError::NoRoots);
                }
                Arc::new(store)
            }
        };
        let client_tls = tls::client_config(roots, None, &[b"http/1.1"])?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(FETCH_TIMEOUT));
        let fetcher = pooled_client(
            &client_tls,
            http,
            Schemes::HttpsOnly,
            2,
            Duration::from_secs(90),
        );
        Ok(OidcAuthenticator {
            config,
            fetcher,
            keys: RwLock::new(Keys {
                set: Arc::new(JwkSet { keys: Vec::new() }),
                fetched: None,
            }),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    /// Whether `token` is a JWT this issuer signed (its unverified `iss`):
    /// such a token is this authenticator's to accept or refuse.
    pub fn claims_issuer(&self, token: &str) -> bool {
        unverified_issuer(token).is_some_and(|issuer| issuer == self.config.issuer)
    }

    /// The user a token of this issuer names, once its signature, issuer,
    /// audience, lifetime and required claims check out.
    pub async fn verify(&self, token: &str) -> Result<User, AuthnError> {
        let rejected = |why: String| AuthnError::Rejected(format!(": OIDC: {why}"));
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| rejected(format!("not a JWT: {e}")))?;
        if !self.config.signing_algs.contains(&header.alg) {
            return Err(rejected(format!(
                "signed with {:?}, which --oidc-signing-algs does not allow",
                header.alg
            )));
        }
        let key = self.key(header.kid.as_deref()).await?;
        let mut validation = Validation::new(header.alg);
        validation.set_issuer(&[&self.config.issuer]);
        validation.set_audience(&[&self.config.client_id]);
        validation.set_required_spec_claims(&["exp", "iss", "aud"]);
        validation.validate_nbf = true;
        validation.leeway = LEEWAY_SECONDS;
        let claims =
            jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &key, &validation)
                .map_err(|e| rejected(e.to_string()))?
                .claims;
        for (name, wanted) in &self.config.required_claims {
            if claims.get(name).and_then(Value::as_str) != Some(wanted.as_str()) {
                return Err(rejected(format!("the claim {name:?} is not {wanted:?}")));
            }
        }
        user_of(&self.config, &claims).map_err(rejected)
    }

    /// The decoding key for `kid`, fetching the key set when it is not
    /// known (at most once per [`REFRESH_AT_MOST_EVERY`]).
    async fn key(&self, kid: Option<&str>) -> Result<DecodingKey, AuthnError> {
        if let Some(key) = self.known_key(kid)? {
            return Ok(key);
        }
        let _one_fetch = self.fetching.lock().await;
        // Another request may have fetched meanwhile.
        if let Some(key) = self.known_key(kid)? {
            return Ok(key);
        }
        let recent = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .fetched
            .is_some_and(|at| at.elapsed() < self.config.keys_refresh_interval);
        if !recent {
            let set = self.fetch_keys().await?;
            let mut keys = self.keys.write().unwrap_or_else(|p| p.into_inner());
            keys.set = Arc::new(set);
            keys.fetched = Some(Instant::now());
        }
        self.known_key(kid)?.ok_or_else(|| {
            AuthnError::Rejected(format!(
                ": OIDC: the issuer publishes no key {}",
                kid.unwrap_or("(the token names none)")
            ))
        })
    }

    fn known_key(&self, kid: Option<&str>) -> Result<Option<DecodingKey>, AuthnError> {
        let set = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .set
            .clone();
        let jwk = match kid {
            Some(kid) => set.find(kid),
            // Without a key id, only an issuer with one key is unambiguous.
            None if set.keys.len() == 1 => set.keys.first(),
            None => None,
        };
        jwk.map(|jwk| {
            DecodingKey::from_jwk(jwk).map_err(|e| {
                AuthnError::Issuer(format!("the issuer's key {kid:?} is not usable: {e}"))
            })
        })
        .transpose()
    }

    async fn fetch_keys(&self) -> Result<JwkSet, AuthnError> {
        let discovery = format!("{}/.well-known/openid-configuration", self.config.issuer);
        let document = self.fetch_json(&discovery).await?;
        let advertised = document.get("issuer").and_then(Value::as_str);
        if advertised != Some(self.config.issuer.as_str()) {
            return Err(AuthnError::Issuer(format!(
                "{discovery} names the issuer {advertised:?}, not {:?}",
                self.config.issuer
            )));
        }
        let jwks_uri = document
            .get("jwks_uri")
            .and_then(Value::as_str)
            .ok_or_else(|| AuthnError::Issuer(format!("{discovery} has no jwks_uri")))?
            .to_owned();
        let set = self.fetch_json(&jwks_uri).await?;
        let set: JwkSet = serde_json::from_value(set)
            .map_err(|e| AuthnError::Issuer(format!("{jwks_uri}: not a JWK set: {e}")))?;
        tracing::info!(
            issuer = self.config.issuer,
            keys = set.keys.len(),
            "fetched the OIDC issuer's keys"
        );
        Ok(set)
    }

    async fn fetch_json(&self, url: &str) -> Result<Value, AuthnError> {
        let failed = |why: String| AuthnError::Issuer(format!("fetching {url}: {why}"));
        let uri: http::Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
        let request = http::Request::get(uri)
            .header(http::header::ACCEPT, "application/json")
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        let response = tokio::time::timeout(FETCH_TIMEOUT, async {
            let response = self
                .fetcher
                .request(request)
                .await
                .map_err(|e| failed(e.to_string()))?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| failed(e.to_string()))?
                .to_bytes();
            Ok::<_, AuthnError>((status, body))
        })
        .await
        .map_err(|_| failed(format!("no answer within {FETCH_TIMEOUT:?}")))??;
        let (status, body) = response;
        if !status.is_success() {
            return Err(failed(format!("answered {status}")));
        }
        serde_json::from_slice(&body).map_err(|e| failed(format!("not JSON: {e}")))
    }
}

/// The `iss` of a JWT, read without verifying anything.
fn unverified_issuer(token: &str) -> Option<String> {
    let mut parts = token.split('.');
    let (_, payload, _, None) = (parts.next()?, parts.next()?, parts.next()?, parts.next()) else {
        return None;
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    let claims: Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("iss")?.as_str().map(str::to_owned)
}

/// The user verified claims name, as kube-apiserver maps them.
fn user_of(config: &OidcConfig, claims: &serde_json::Map<String, Value>) -> Result<User, String> {
    let name = claims
        .get(&config.username_claim)
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("no {:?} claim to name the user", config.username_claim))?;
    if config.username_claim == "email"
        && claims
            .get("email_verified")
            .is_some_and(|v| v != &Value::Bool(true))
    {
        return Err("the email is not verified (email_verified is not true)".into());
    }
    let name = format!("{}{name}", config.username_prefix);
    let mut groups = Vec::new();
    if let Some(claim) = &config.groups_claim {
        match claims.get(claim) {
            None | Some(Value::Null) => {}
            Some(Value::String(group)) => groups.push(group.clone()),
            Some(Value::Array(items)) => {
                for item in items {
                    let group = item
                        .as_str()
                        .ok_or_else(|| format!("the {claim:?} claim holds a non-string"))?;
                    groups.push(group.to_owned());
                }
            }
            Some(_) => {
                return Err(format!(
                    "the {claim:?} claim is neither a string nor a list"
                ));
            }
        }
    }
    let groups: Vec<String> = groups
        .into_iter()
        .map(|g| format!("{}{g}", config.groups_prefix))
        .collect();
    if let Some(reserved) = std::iter::once(&name)
        .chain(&groups)
        .find(|n| n.starts_with(RESERVED_PREFIX))
    {
        return Err(format!(
            "{reserved:?} starts with the reserved prefix {RESERVED_PREFIX:?}"
        ));
    }
    let mut groups = groups;
    groups.push("system:authenticated".to_owned());
    Ok(User {
        name,
        uid: String::new(),
        groups,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config() -> OidcConfig {
        OidcConfig {
            issuer: "https://idp.example.com".into(),
            client_id: "cluster-proxy".into(),
            username_claim: "sub".into(),
            username_prefix: "https://idp.example.com#".into(),
            groups_claim: Some("groups".into()),
            groups_prefix: "oidc:".into(),
            ca_file: None,
            signing_algs: vec![Algorithm::RS256],
            required_claims: Vec::new(),
            keys_refresh_interval: REFRESH_AT_MOST_EVERY,
        }
    }

    fn claims(value: Value) -> serde_json::Map<String, Value> {
        value.as_object().cloned().unwrap()
    }

    #[test]
    fn claims_map_to_a_prefixed_user_and_groups() {
        let user = user_of(
            &config(),
            &claims(json!({"sub": "dave", "groups": ["a", "b"]})),
        )
        .unwrap();
        assert_eq!(user.name, "https://idp.example.com#dave");
        assert_eq!(user.groups, ["oidc:a", "oidc:b", "system:authenticated"]);
        let user = user_of(&config(), &claims(json!({"sub": "dave", "groups": "a"}))).unwrap();
        assert_eq!(user.groups, ["oidc:a", "system:authenticated"]);
        let user = user_of(&config(), &claims(json!({"sub": "dave"}))).unwrap();
        assert_eq!(user.groups, ["system:authenticated"]);
    }

    #[test]
    fn bad_claims_are_refused() {
        let email = OidcConfig {
            username_claim: "email".into(),
            username_prefix: String::new(),
            groups_prefix: String::new(),
            ..config()
        };
        for (config, claims, says) in [
            (config(), json!({"groups": []}), "no \"sub\""),
            (config(), json!({"sub": "d", "groups": [1]}), "non-string"),
            (config(), json!({"sub": "d", "groups": {"a": 1}}), "neither"),
            (
                email.clone(),
                json!({"email": "d@x", "email_verified": false}),
                "not verified",
            ),
            (email.clone(), json!({"email": "system:admin"}), "reserved"),
            (
                email,
                json!({"email": "d@x", "groups": ["system:masters"]}),
                "reserved",
            ),
        ] {
            let error = user_of(&config, &super::tests::claims(claims)).unwrap_err();
            assert!(error.contains(says), "{error} should say {says}");
        }
    }

    #[test]
    fn the_issuer_is_read_only_from_a_three_part_token() {
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"iss":"https://idp.example.com","sub":"d"}"#);
        assert_eq!(
            unverified_issuer(&format!("e30.{payload}.sig")).as_deref(),
            Some("https://idp.example.com")
        );
        for token in [
            "opaque-token",
            "a.b",
            &format!("e30.{payload}.sig.extra"),
            "e30.!!!.x",
        ] {
            assert_eq!(unverified_issuer(token), None, "{token}");
        }
    }
}
