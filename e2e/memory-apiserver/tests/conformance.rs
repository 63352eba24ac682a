//! The Kubernetes API conformance table (`conformance/cases.yaml`): each
//! case is a list of requests with the answer the real kube-apiserver
//! gives. It runs against the in-memory API by default, and against any
//! cluster whose kubeconfig `CONFORMANCE_KUBECONFIG` names (some cases then
//! need kube-controller-manager: garbage collection, namespace deletion).
//!
//! A case runs in a namespace of its own (`{ns}`); `{id}` makes
//! cluster-scoped names unique; `capture` keeps a value of an answer for
//! later steps (`{name}`); `wait` repeats a step until its expectation
//! holds (at most 30 s); `headers` adds request headers (the
//! administrator impersonating an unprivileged user, for RBAC cases). An expectation names the status `code`, and may
//! name the `reason`, the exact `message`, a `json` subset of the answer,
//! and JSON pointers that must be `absent` or `present`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kube::Client;
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde::Deserialize;
use serde_json::Value;

const CASES: &str = include_str!("conformance/cases.yaml");
const WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    steps: Vec<Step>,
}

#[derive(Debug, Deserialize)]
struct Step {
    method: String,
    path: String,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    body: Option<Value>,
    /// Extra request headers (`Impersonate-User` to ask as someone else).
    #[serde(default)]
    headers: BTreeMap<String, String>,
    expect: Expect,
    #[serde(default)]
    capture: BTreeMap<String, String>,
    #[serde(default)]
    wait: bool,
}

#[derive(Debug, Deserialize)]
struct Expect {
    code: u16,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: Option<String>,
    /// A subset of the answer: every key given must match.
    #[serde(default)]
    json: Option<Value>,
    /// JSON pointers the answer must not have.
    #[serde(default)]
    absent: Vec<String>,
    /// JSON pointers the answer must have, whatever their value.
    #[serde(default)]
    present: Vec<String>,
}

/// Whether `actual` has everything `expected` has (objects by key, lists
/// item by item with the same length, anything else equal).
fn contains(actual: &Value, expected: &Value) -> bool {
    match (actual, expected) {
        (Value::Object(a), Value::Object(e)) => e
            .iter()
            .all(|(k, v)| a.get(k).is_some_and(|av| contains(av, v))),
        (Value::Array(a), Value::Array(e)) => {
            a.len() == e.len() && a.iter().zip(e).all(|(av, ev)| contains(av, ev))
        }
        _ => actual == expected,
    }
}

fn substitute(text: &str, vars: &BTreeMap<String, String>) -> String {
    vars.iter().fold(text.to_string(), |t, (k, v)| {
        t.replace(&format!("{{{k}}}"), v)
    })
}

/// Why an answer is not the expected one, if it is not.
fn mismatch(
    expect: &Expect,
    code: u16,
    body: &Value,
    vars: &BTreeMap<String, String>,
) -> Option<String> {
    let mut problems = Vec::new();
    if code != expect.code {
        problems.push(format!("code {code}, expected {}", expect.code));
    }
    if let Some(reason) = &expect.reason
        && body.get("reason").and_then(Value::as_str) != Some(reason.as_str())
    {
        problems.push(format!(
            "reason {:?}, expected {reason:?}",
            body.get("reason")
        ));
    }
    if let Some(message) = &expect.message {
        let message = substitute(message, vars);
        if body.get("message").and_then(Value::as_str) != Some(message.as_str()) {
            problems.push(format!(
                "message {:?}, expected {message:?}",
                body.get("message")
            ));
        }
    }
    if let Some(json) = &expect.json {
        let json: Value = serde_json::from_str(&substitute(&json.to_string(), vars))
            .unwrap_or_else(|e| panic!("expected JSON after substitution: {e}"));
        if !contains(body, &json) {
            problems.push(format!("answer does not contain {json}"));
        }
    }
    for pointer in &expect.absent {
        if body.pointer(pointer).is_some() {
            problems.push(format!("answer has {pointer}"));
        }
    }
    for pointer in &expect.present {
        if body.pointer(pointer).is_none() {
            problems.push(format!("answer lacks {pointer}"));
        }
    }
    if problems.is_empty() {
        None
    } else {
        Some(format!("{}; answer: {body}", problems.join("; ")))
    }
}

async fn send(client: &Client, step: &Step, vars: &BTreeMap<String, String>) -> (u16, Value) {
    let path = substitute(&step.path, vars);
    let body = step
        .body
        .as_ref()
        .map(|b| substitute(&b.to_string(), vars).into_bytes())
        .unwrap_or_default();
    let content_type = step
        .content_type
        .clone()
        .unwrap_or_else(|| "application/json".into());
    let mut request = http::Request::builder()
        .method(step.method.as_str())
        .uri(path)
        .header("content-type", content_type);
    if !step
        .headers
        .keys()
        .any(|h| h.eq_ignore_ascii_case("accept"))
    {
        request = request.header("accept", "application/json");
    }
    for (name, value) in &step.headers {
        request = request.header(name.as_str(), substitute(value, vars));
    }
    let request = request.body(kube::client::Body::from(body)).unwrap();
    let response = client.send(request).await.unwrap();
    let code = response.status().as_u16();
    let bytes = response.into_body().collect_bytes().await.unwrap();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (code, value)
}

async fn run_case(client: &Client, index: usize, case: &Case) -> Result<(), String> {
    let id = format!("{index}x{:06x}", rand::random::<u32>() & 0xff_ffff);
    let mut vars = BTreeMap::from([
        ("id".to_string(), id.clone()),
        ("ns".to_string(), format!("cf-{id}")),
    ]);
    let setup = Step {
        method: "POST".into(),
        path: "/api/v1/namespaces".into(),
        content_type: None,
        body: Some(serde_json::json!({"metadata": {"name": "{ns}"}})),
        headers: BTreeMap::new(),
        expect: Expect {
            code: 201,
            reason: None,
            message: None,
            json: None,
            absent: Vec::new(),
            present: Vec::new(),
        },
        capture: BTreeMap::new(),
        wait: false,
    };
    let (code, body) = send(client, &setup, &vars).await;
    if code != 201 {
        return Err(format!("creating the case's namespace: {code} {body}"));
    }
    for (n, step) in case.steps.iter().enumerate() {
        let started = Instant::now();
        let (code, body) = loop {
            let (code, body) = send(client, step, &vars).await;
            if !step.wait
                || mismatch(&step.expect, code, &body, &vars).is_none()
                || started.elapsed() > WAIT
            {
                break (code, body);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        if let Some(problem) = mismatch(&step.expect, code, &body, &vars) {
            return Err(format!(
                "step {n} ({} {}): {problem}",
                step.method,
                substitute(&step.path, &vars)
            ));
        }
        for (name, pointer) in &step.capture {
            let value = body
                .pointer(pointer)
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                .ok_or_else(|| format!("step {n}: no {pointer} to capture in {body}"))?;
            vars.insert(name.clone(), value);
        }
    }
    // Cleanup is best effort: a real cluster finishes it in the background.
    let cleanup = Step {
        method: "DELETE".into(),
        path: "/api/v1/namespaces/{ns}".into(),
        content_type: None,
        body: None,
        headers: BTreeMap::new(),
        expect: Expect {
            code: 200,
            reason: None,
            message: None,
            json: None,
            absent: Vec::new(),
            present: Vec::new(),
        },
        capture: BTreeMap::new(),
        wait: false,
    };
    let _ = send(client, &cleanup, &vars).await;
    Ok(())
}

#[tokio::test]
async fn the_api_answers_as_kube_apiserver_does() {
    let cases: Vec<Case> = serde_saphyr::from_str(CASES).expect("cases.yaml");
    let dir = tempfile::tempdir().unwrap();
    let (client, _api, against) = match std::env::var("CONFORMANCE_KUBECONFIG") {
        Ok(path) if !path.is_empty() => {
            let client = KubeApi::client_from(std::path::Path::new(&path))
                .await
                .unwrap();
            (client, None, format!("the cluster of {path}"))
        }
        _ => {
            // A real cluster authorizes by RBAC; so does the stand-in here.
            let mut options = KubeApiOptions::new(dir.path());
            options.rbac = true;
            let api = KubeApi::start(options).await.unwrap();
            (
                api.client().await.unwrap(),
                Some(api),
                "the in-memory API".to_string(),
            )
        }
    };
    let mut failures = Vec::new();
    for (index, case) in cases.iter().enumerate() {
        match run_case(&client, index, case).await {
            Ok(()) => eprintln!("pass  {}", case.name),
            Err(problem) => {
                eprintln!("FAIL  {}: {problem}", case.name);
                failures.push(format!("{}: {problem}", case.name));
            }
        }
    }
    eprintln!(
        "{} of {} cases pass against {against}",
        cases.len() - failures.len(),
        cases.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
