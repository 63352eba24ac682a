//! The real kubectl against the in-memory API, as a newcomer uses it
//! against `cargo run -p e2e -- up`: every command the README promises.
//!
//! Without kubectl (1.27 or newer: `auth whoami`, OpenAPI v3 `explain`)
//! the tests are skipped loudly; under `CI=true` that is a failure
//! (`.ci/run` installs kubectl when the machine has none).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use kube::Api;
use kube::api::{Patch, PatchParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use memory_apiserver::{KubeApi, KubeApiOptions};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const WIDGETS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.example.io
spec:
  group: example.io
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget, shortNames: [wg], categories: [all]}
  versions:
  - name: v1
    served: true
    storage: true
    subresources: {status: {}}
    additionalPrinterColumns:
    - {name: Size, type: integer, jsonPath: .spec.size}
    - {name: Colour, type: string, jsonPath: .spec.colour}
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            description: What the widget should be.
            properties:
              size: {type: integer, description: How many parts the widget has.}
              colour: {type: string}
          status:
            type: object
            properties:
              conditions:
                type: array
                items:
                  type: object
                  properties:
                    type: {type: string}
                    status: {type: string}
"#;

/// kubectl 1.27 brought `auth whoami` out of alpha.
const OLDEST_MINOR: u64 = 27;

/// Whether kubectl can run these tests; `None` (after saying why) when they
/// are skipped.
async fn kubectl_available() -> Option<()> {
    let under_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let problem = match Command::new("kubectl")
        .args(["version", "--client", "-o", "json"])
        .output()
        .await
    {
        Err(e) => format!("kubectl is not runnable ({e})"),
        Ok(output) => {
            let version: Value = serde_json::from_slice(&output.stdout).unwrap_or(Value::Null);
            let minor = version
                .pointer("/clientVersion/minor")
                .and_then(Value::as_str)
                .map(|m| m.trim_end_matches('+'))
                .and_then(|m| m.parse::<u64>().ok());
            match minor {
                Some(minor) if minor >= OLDEST_MINOR => return Some(()),
                _ => format!(
                    "kubectl 1.{OLDEST_MINOR} or newer is needed; `kubectl version --client` said {}",
                    String::from_utf8_lossy(&output.stdout).trim()
                ),
            }
        }
    };
    assert!(!under_ci, "under CI kubectl must be installed: {problem}");
    // Straight to the process's stderr: libtest hides `eprintln!` of a
    // passing test, and a skip must be seen.
    let _ = writeln!(std::io::stderr(), "SKIPPED kubectl tests: {problem}");
    None
}

/// One in-memory API and a kubectl configured for it, with a cache
/// directory of its own.
struct Setup {
    api: KubeApi,
    kubeconfig: PathBuf,
    home: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

impl Setup {
    async fn start(rbac: bool) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let mut options = KubeApiOptions::new(dir.path());
        options.rbac = rbac;
        let api = KubeApi::start(options).await.unwrap();
        api.register_crds_from_yaml(WIDGETS).unwrap();
        Setup {
            kubeconfig: api.kubeconfig_path().to_path_buf(),
            api,
            home: tempfile::tempdir().unwrap(),
            _dir: dir,
        }
    }

    fn command(&self, kubeconfig: &Path, args: &[&str]) -> Command {
        let mut command = Command::new("kubectl");
        command
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .env("HOME", self.home.path())
            .env("KUBECACHEDIR", self.home.path().join("cache"))
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    async fn run_as(&self, kubeconfig: &Path, args: &[&str]) -> Output {
        tokio::time::timeout(
            Duration::from_secs(60),
            self.command(kubeconfig, args).output(),
        )
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} did not finish in 60 s"))
        .unwrap()
    }

    async fn run(&self, args: &[&str]) -> Output {
        self.run_as(&self.kubeconfig, args).await
    }

    /// Runs kubectl, which must succeed; its standard output.
    async fn ok(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert!(
            output.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs kubectl, which must fail; its standard error.
    async fn fails(&self, args: &[&str]) -> String {
        let output = self.run(args).await;
        assert!(
            !output.status.success(),
            "kubectl {args:?} succeeded: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    }

    async fn json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&args).await).unwrap()
    }

    fn write(&self, name: &str, text: &str) -> String {
        let path = self.home.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    async fn widgets(&self) -> Api<DynamicObject> {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("example.io", "v1", "Widget"),
            "widgets",
        );
        Api::namespaced_with(self.api.client().await.unwrap(), "default", &resource)
    }
}

/// The header line and the row of `name` in kubectl's table output.
fn table_row(output: &str, name: &str) -> (Vec<String>, Vec<String>) {
    let cells = |line: &str| -> Vec<String> { line.split_whitespace().map(String::from).collect() };
    let mut lines = output.lines();
    let header = cells(lines.next().unwrap_or_default());
    let row = lines
        .map(cells)
        .find(|row| row.first().map(String::as_str) == Some(name))
        .unwrap_or_else(|| panic!("no row {name:?} in:\n{output}"));
    (header, row)
}

#[tokio::test(flavor = "multi_thread")]
async fn create_get_describe_delete_built_in_objects() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(false).await;
    // Typed `create` subcommands send protobuf bodies.
    assert!(
        setup
            .ok(&["create", "namespace", "team-a"])
            .await
            .contains("namespace/team-a created")
    );
    setup
        .ok(&[
            "create",
            "configmap",
            "settings",
            "-n",
            "team-a",
            "--from-literal=colour=blue",
            "--from-literal=size=3",
        ])
        .await;
    setup
        .ok(&[
            "create",
            "secret",
            "generic",
            "token",
            "-n",
            "team-a",
            "--from-literal=key=s3cret",
        ])
        .await;
    setup
        .ok(&["create", "serviceaccount", "robot", "-n", "team-a"])
        .await;

    // Short names, and the built-in printer columns.
    let (header, row) = table_row(&setup.ok(&["get", "ns"]).await, "team-a");
    assert_eq!(header, ["NAME", "STATUS", "AGE"]);
    assert_eq!(row[1], "Active");
    let (header, row) = table_row(&setup.ok(&["get", "cm", "-n", "team-a"]).await, "settings");
    assert_eq!(header, ["NAME", "DATA", "AGE"]);
    assert_eq!(row[1], "2");
    let secret = setup
        .json(&["get", "secret", "token", "-n", "team-a"])
        .await;
    assert_eq!(secret["data"]["key"], "czNjcmV0");
    assert_eq!(secret["type"], "Opaque");
    let sa = setup.json(&["get", "sa", "robot", "-n", "team-a"]).await;
    assert_eq!(sa["metadata"]["namespace"], "team-a");

    let described = setup
        .ok(&["describe", "cm", "settings", "-n", "team-a"])
        .await;
    assert!(described.contains("Name:         settings"), "{described}");
    assert!(described.contains("colour"), "{described}");
    let described = setup.ok(&["describe", "namespace", "team-a"]).await;
    assert!(described.contains("Status:       Active"), "{described}");

    assert!(
        setup
            .ok(&["delete", "cm", "settings", "-n", "team-a"])
            .await
            .contains("\"settings\" deleted")
    );
    let error = setup
        .fails(&["get", "cm", "settings", "-n", "team-a"])
        .await;
    assert!(error.contains("NotFound"), "{error}");
}

#[tokio::test(flavor = "multi_thread")]
async fn apply_validates_on_the_server_and_merges() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(false).await;
    let manifest = |colour: &str, extra: &str| {
        format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  namespace: default\ndata:\n  colour: {colour}\n{extra}"
        )
    };
    let file = setup.write("cm.yaml", &manifest("red", ""));
    assert!(
        setup
            .ok(&["apply", "-f", &file])
            .await
            .contains("configmap/applied created")
    );
    let file = setup.write("cm.yaml", &manifest("green", ""));
    assert!(
        setup
            .ok(&["apply", "-f", &file])
            .await
            .contains("configmap/applied configured")
    );
    let applied = setup.json(&["get", "cm", "applied"]).await;
    assert_eq!(applied["data"]["colour"], "green");
    assert!(
        applied["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"]
            .is_string()
    );

    // Validation is on (kubectl's default): a misspelt field is refused by
    // the server, which the OpenAPI document says checks fields itself.
    let file = setup.write("bad.yaml", &manifest("green", "colour: red\n"));
    let error = setup.fails(&["apply", "-f", &file]).await;
    assert!(
        error.contains("strict decoding error: unknown field \"colour\""),
        "{error}"
    );
    let widget = "apiVersion: example.io/v1\nkind: Widget\nmetadata:\n  name: w\n  namespace: default\nspec:\n  size: 2\n  shape: round\n";
    let file = setup.write("widget.yaml", widget);
    let error = setup.fails(&["apply", "-f", &file]).await;
    assert!(error.contains("unknown field \"spec.shape\""), "{error}");

    let file = setup.write("ssa.yaml", &manifest("blue", ""));
    assert!(
        setup
            .ok(&["apply", "--server-side", "--force-conflicts", "-f", &file])
            .await
            .contains("configmap/applied serverside-applied")
    );
    let applied = setup
        .json(&["get", "cm", "applied", "--show-managed-fields"])
        .await;
    assert_eq!(applied["data"]["colour"], "blue");
    let managers: Vec<&str> = applied["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["operation"] == "Apply")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    // kubectl moves the client-side owner's fields to its apply manager
    // (keeping the last-applied annotation with `kubectl-last-applied`).
    assert!(managers.contains(&"kubectl"), "{managers:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn edit_runs_the_editor_and_patches() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(false).await;
    setup
        .ok(&["create", "configmap", "edited", "--from-literal=colour=red"])
        .await;
    let editor = setup.write(
        "editor.sh",
        "#!/bin/sh\nsed -i 's/colour: red/colour: purple/' \"$1\"\n",
    );
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let output = setup
        .command(&setup.kubeconfig, &["edit", "configmap", "edited"])
        .env("EDITOR", &editor)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let edited = setup.json(&["get", "cm", "edited"]).await;
    assert_eq!(edited["data"]["colour"], "purple");

    // Editing a list sends a strategic merge patch with `$` directives.
    setup
        .ok(&["label", "configmap", "edited", "tier=gold"])
        .await;
    setup
        .ok(&[
            "patch",
            "configmap",
            "edited",
            "-p",
            r#"{"metadata":{"finalizers":["example.io/a","example.io/b"]}}"#,
        ])
        .await;
    let editor = setup.write(
        "reorder.sh",
        "#!/bin/sh\nsed -i 's|example.io/a|example.io/c|' \"$1\"\n",
    );
    std::fs::set_permissions(&editor, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let output = setup
        .command(&setup.kubeconfig, &["edit", "configmap", "edited"])
        .env("EDITOR", &editor)
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let edited = setup.json(&["get", "cm", "edited"]).await;
    assert_eq!(
        edited["metadata"]["finalizers"],
        json!(["example.io/c", "example.io/b"])
    );
    setup
        .ok(&[
            "patch",
            "configmap",
            "edited",
            "--type=merge",
            "-p",
            r#"{"metadata":{"finalizers":null}}"#,
        ])
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn explain_reads_built_in_and_custom_schemas() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(false).await;
    let explained = setup.ok(&["explain", "deployments.spec.replicas"]).await;
    assert!(explained.contains("KIND:       Deployment"), "{explained}");
    assert!(
        explained.contains("FIELD: replicas <integer>"),
        "{explained}"
    );
    let explained = setup.ok(&["explain", "cm"]).await;
    assert!(explained.contains("binaryData"), "{explained}");
    let explained = setup.ok(&["explain", "widgets.spec"]).await;
    assert!(
        explained.contains("What the widget should be."),
        "{explained}"
    );
    assert!(
        explained.contains("How many parts the widget has."),
        "{explained}"
    );
    let error = setup.fails(&["explain", "widgets.spec.shape"]).await;
    assert!(error.contains("shape"), "{error}");

    // CRDs applied with validation on are checked against the CRD schema
    // itself, and then explained from their own.
    let crds = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../simulated-cluster/crds/ocm.yaml"
    );
    setup.ok(&["apply", "-f", crds]).await;
    let explained = setup.ok(&["explain", "managedclusters.spec"]).await;
    assert!(
        explained.contains("GROUP:      cluster.open-cluster-management.io"),
        "{explained}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn custom_objects_print_columns_wait_and_watch() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(false).await;
    let widget = |name: &str| {
        format!(
            "apiVersion: example.io/v1\nkind: Widget\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  size: 3\n  colour: teal\n"
        )
    };
    setup
        .ok(&["apply", "-f", &setup.write("first.yaml", &widget("first"))])
        .await;
    let (header, row) = table_row(&setup.ok(&["get", "wg"]).await, "first");
    assert_eq!(header, ["NAME", "SIZE", "COLOUR", "AGE"]);
    assert_eq!(row[1..3], ["3", "teal"]);
    let everything = setup.ok(&["get", "all"]).await;
    assert!(
        everything.contains("widget.example.io/first"),
        "{everything}"
    );

    // The CRD is Established, and the widget is not Ready yet.
    setup
        .ok(&[
            "wait",
            "--for=condition=Established",
            "crd/widgets.example.io",
            "--timeout=10s",
        ])
        .await;
    let error = setup
        .fails(&[
            "wait",
            "--for=condition=Ready",
            "widget/first",
            "--timeout=1s",
        ])
        .await;
    assert!(error.contains("timed out"), "{error}");
    let waiting = setup
        .command(
            &setup.kubeconfig,
            &[
                "wait",
                "--for=condition=Ready",
                "widget/first",
                "--timeout=30s",
            ],
        )
        .output();
    let widgets = setup.widgets().await;
    let mark_ready = async {
        widgets
            .patch_status(
                "first",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
                ),
            )
            .await
            .unwrap();
    };
    let (waited, ()) = tokio::join!(waiting, mark_ready);
    let waited = waited.unwrap();
    assert!(
        waited.status.success(),
        "{}",
        String::from_utf8_lossy(&waited.stderr)
    );
    assert!(String::from_utf8_lossy(&waited.stdout).contains("condition met"));

    // `get -w`: the current objects, then each change as it happens.
    let mut watching = setup
        .command(&setup.kubeconfig, &["get", "widgets", "-w", "-o", "name"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watching.stdout.take().unwrap()).lines();
    let mut next_line = async || {
        tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("a line from kubectl get -w within 30 s")
            .unwrap()
            .expect("kubectl get -w ended early")
    };
    assert_eq!(next_line().await, "widget.example.io/first");
    setup
        .ok(&[
            "apply",
            "-f",
            &setup.write("second.yaml", &widget("second")),
        ])
        .await;
    assert_eq!(next_line().await, "widget.example.io/second");
    watching.start_kill().unwrap();
    watching.wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn auth_whoami_and_can_i_with_and_without_rbac() {
    if kubectl_available().await.is_none() {
        return;
    }
    let open = Setup::start(false).await;
    let someone = open.api.kubeconfig_for("someone", &["team"]).unwrap();
    let output = open
        .run_as(&someone, &["auth", "can-i", "delete", "namespaces"])
        .await;
    assert!(output.status.success());
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "yes");
    let whoami = open
        .run_as(&someone, &["auth", "whoami", "-o", "json"])
        .await;
    let review: Value = serde_json::from_slice(&whoami.stdout).unwrap();
    assert_eq!(review["status"]["userInfo"]["username"], "someone");
    assert_eq!(
        review["status"]["userInfo"]["groups"],
        json!(["team", "system:authenticated"])
    );

    let guarded = Setup::start(true).await;
    assert_eq!(
        guarded
            .ok(&["auth", "can-i", "create", "pods"])
            .await
            .trim(),
        "yes"
    );
    let nobody = guarded.api.kubeconfig_for("nobody", &[]).unwrap();
    let output = guarded
        .run_as(&nobody, &["auth", "can-i", "create", "pods"])
        .await;
    assert!(!output.status.success());
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "no");
    // Typed `create role` / `create rolebinding` send protobuf too.
    guarded
        .ok(&[
            "create",
            "role",
            "read-secrets",
            "--verb=get,list",
            "--resource=secrets",
            "-n",
            "default",
        ])
        .await;
    guarded
        .ok(&[
            "create",
            "rolebinding",
            "read-secrets",
            "--role=read-secrets",
            "--user=nobody",
            "-n",
            "default",
        ])
        .await;
    let output = guarded
        .run_as(
            &nobody,
            &["auth", "can-i", "list", "secrets", "-n", "default"],
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "yes");
    let role = guarded
        .json(&["get", "role", "read-secrets", "-n", "default"])
        .await;
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}])
    );
    let grant = "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: read-config, namespace: default}\nrules:\n- {apiGroups: [''], resources: [configmaps], verbs: [get, list]}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: read-config, namespace: default}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: read-config}\nsubjects:\n- {apiGroup: rbac.authorization.k8s.io, kind: User, name: nobody}\n";
    guarded
        .ok(&["apply", "-f", &guarded.write("grant.yaml", grant)])
        .await;
    let output = guarded
        .run_as(
            &nobody,
            &["auth", "can-i", "list", "configmaps", "-n", "default"],
        )
        .await;
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "yes");
}

/// Runs pod `shell-0` (one container, `main`) whose commands run in
/// `dir` and whose log is `log`.
fn shell_pod(api: &KubeApi, dir: &Path, log: &Path) {
    use memory_apiserver::pods::{ContainerRuntime, ExecContext, RunningPod};
    api.kubelet()
        .run(&RunningPod {
            namespace: "default".into(),
            name: "shell-0".into(),
            ready: true,
            containers: std::collections::BTreeMap::from([(
                "main".to_owned(),
                ContainerRuntime {
                    log: Some(log.to_path_buf()),
                    exec: Some(ExecContext {
                        dir: dir.to_path_buf(),
                        env: vec![("GREETING".into(), "from the pod".into())],
                        netns: None,
                    }),
                },
            )]),
            ..RunningPod::default()
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_cp_and_logs_reach_the_kubelets_processes() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(true).await;
    let pod_dir = tempfile::tempdir().unwrap();
    let log = pod_dir.path().join("main.log");
    std::fs::write(&log, "starting\nlistening on :8080\n").unwrap();
    shell_pod(&setup.api, pod_dir.path(), &log);

    // kubectl exec (WebSocket v5): output, stderr, the environment and the
    // directory of the container, and its exit code.
    let output = setup
        .run(&[
            "exec",
            "shell-0",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING in $(pwd)\"; echo oops >&2; exit 3",
        ])
        .await;
    assert_eq!(output.status.code(), Some(3), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("from the pod in {}", pod_dir.path().display())
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("oops"));
    // Stdin reaches the command, and its end (v5's close) ends `cat`.
    let mut cat = setup.command(&setup.kubeconfig, &["exec", "-i", "shell-0", "--", "cat"]);
    cat.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut cat = cat.spawn().unwrap();
    let mut stdin = cat.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"through stdin\n")
        .await
        .unwrap();
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(60), cat.wait_with_output())
        .await
        .expect("cat ends once its stdin does")
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "through stdin\n");
    let missing = setup
        .fails(&["exec", "shell-0", "--", "no-such-command"])
        .await;
    assert!(missing.contains("no-such-command"), "{missing}");
    let denied = setup.fails(&["exec", "stray", "--", "true"]).await;
    assert!(
        denied.contains("NotFound") || denied.contains("not found"),
        "{denied}"
    );

    // kubectl cp, both ways (tar through exec).
    let local = setup.home.path().join("payload.bin");
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    std::fs::write(&local, &payload).unwrap();
    let inside = pod_dir.path().join("copied.bin");
    setup
        .ok(&[
            "cp",
            &local.to_string_lossy(),
            &format!("default/shell-0:{}", inside.display()),
        ])
        .await;
    assert!(
        std::fs::read(&inside).unwrap() == payload,
        "copied in differs"
    );
    let back = setup.home.path().join("back.bin");
    setup
        .ok(&[
            "cp",
            &format!("default/shell-0:{}", inside.display()),
            &back.to_string_lossy(),
        ])
        .await;
    assert!(
        std::fs::read(&back).unwrap() == payload,
        "copied out differs"
    );

    // kubectl logs: all, the tail, and followed until the pod goes.
    assert_eq!(
        setup.ok(&["logs", "shell-0"]).await,
        "starting\nlistening on :8080\n"
    );
    assert_eq!(
        setup.ok(&["logs", "shell-0", "--tail=1"]).await,
        "listening on :8080\n"
    );
    let refused = setup.fails(&["logs", "shell-0", "--timestamps"]).await;
    assert!(refused.contains("timestamps"), "{refused}");
    let mut follow = setup.command(&setup.kubeconfig, &["logs", "-f", "shell-0", "--tail=0"]);
    follow.stdout(Stdio::piped());
    let mut follow = follow.spawn().unwrap();
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    let seen = append_until_seen(&log, "request served", &mut lines).await;
    assert_eq!(seen.as_deref(), Some("request served"));
    setup.api.kubelet().remove("default", "shell-0").unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), follow.wait())
        .await
        .expect("logs -f ends with the pod")
        .unwrap();
    assert!(status.success(), "{status:?}");

    // RBAC: reading pods is not exec'ing into them, nor reading their logs.
    shell_pod(&setup.api, pod_dir.path(), &log);
    setup
        .ok(&[
            "create",
            "role",
            "read-pods",
            "--verb=get,list",
            "--resource=pods",
            "-n",
            "default",
        ])
        .await;
    setup
        .ok(&[
            "create",
            "rolebinding",
            "read-pods",
            "--role=read-pods",
            "--user=viewer",
            "-n",
            "default",
        ])
        .await;
    let viewer = setup.api.kubeconfig_for("viewer", &[]).unwrap();
    let output = setup
        .run_as(&viewer, &["exec", "shell-0", "--", "true"])
        .await;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("pods/exec") && stderr.contains("viewer"),
        "{stderr}"
    );
    let output = setup.run_as(&viewer, &["logs", "shell-0"]).await;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success() && stderr.contains("pods/log"),
        "{stderr}"
    );
}

/// A TCP echo listener: what a pod's container port serves here.
async fn echo_listener() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = tcp.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    addr
}

/// `kubectl port-forward` until it says where it listens; the child and
/// the local port.
async fn port_forward(mut command: Command) -> (tokio::process::Child, u16) {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            // "Forwarding from 127.0.0.1:40123 -> 7000"
            if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
                return rest
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .parse::<u16>()
                    .unwrap();
            }
        }
        panic!("kubectl port-forward ended without forwarding");
    })
    .await
    .expect("kubectl port-forward listens within 60 s");
    // Keep reading, or kubectl blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, port)
}

/// Echoes `size` bytes through `port` and checks them.
async fn echo_through(port: u16, size: usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let payload: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let (mut read, mut write) = tcp.split();
    let (written, back) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(write.write_all(&payload), async {
            let mut back = vec![0u8; size];
            read.read_exact(&mut back).await.map(|_| back)
        })
    })
    .await
    .expect("echoed within 60 s");
    written.unwrap();
    assert!(back.unwrap() == payload, "the echo differs");
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_over_spdy_and_spdy_in_websocket() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(true).await;
    let echo = echo_listener().await;
    setup
        .api
        .kubelet()
        .run(&memory_apiserver::pods::RunningPod {
            namespace: "default".into(),
            name: "echo-0".into(),
            ports: vec![("echo".into(), 7000, echo)],
            ready: true,
            ..Default::default()
        })
        .unwrap();
    // kubectl 1.31+ tunnels SPDY in WebSocket; `false` makes it speak
    // plain SPDY, as client-go's SPDY dialer does.
    for websockets in ["true", "false"] {
        let mut command = setup.command(
            &setup.kubeconfig,
            &["port-forward", "pod/echo-0", ":7000", "-n", "default"],
        );
        command.env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websockets);
        let (mut child, port) = port_forward(command).await;
        // Two connections one after the other, then two at once: each is
        // its own pair of streams on the one session.
        echo_through(port, 1024 * 1024).await;
        echo_through(port, 10).await;
        tokio::join!(echo_through(port, 300_000), echo_through(port, 300_000));
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
    // A container port nothing listens on: the kubelet's reason reaches
    // kubectl, which says so.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = closed.local_addr().unwrap();
    drop(closed);
    setup
        .api
        .kubelet()
        .run(&memory_apiserver::pods::RunningPod {
            namespace: "default".into(),
            name: "dead-0".into(),
            ports: vec![("dead".into(), 7001, dead)],
            ready: true,
            ..Default::default()
        })
        .unwrap();
    let mut command = setup.command(
        &setup.kubeconfig,
        &["port-forward", "pod/dead-0", ":7001", "-n", "default"],
    );
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = command.spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let port = loop {
        let line = lines.next_line().await.unwrap().unwrap();
        if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
            break rest
                .split_whitespace()
                .next()
                .unwrap()
                .parse::<u16>()
                .unwrap();
        }
    };
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::AsyncReadExt::read(&mut tcp, &mut buf),
    )
    .await
    .expect("the forwarded connection ends");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    let output = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("kubectl gives up on the dead port")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("error forwarding port 7001") && stderr.contains("connection refused"),
        "{stderr}"
    );
}

/// kubectl's SPDY executor (`KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false`,
/// and its fallback when a WebSocket upgrade is refused): exit codes,
/// stderr, stdin to its end, and `kubectl cp` both ways.
#[tokio::test(flavor = "multi_thread")]
async fn exec_and_cp_over_spdy() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(true).await;
    let pod_dir = tempfile::tempdir().unwrap();
    let log = pod_dir.path().join("main.log");
    std::fs::write(&log, "").unwrap();
    shell_pod(&setup.api, pod_dir.path(), &log);
    let spdy = |args: &[&str]| {
        let mut command = setup.command(&setup.kubeconfig, args);
        command.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false");
        command
    };
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        spdy(&[
            "exec",
            "shell-0",
            "--",
            "sh",
            "-c",
            "echo \"$GREETING\"; echo oops >&2; exit 5",
        ])
        .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(output.status.code(), Some(5), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout), "from the pod\n");
    assert!(String::from_utf8_lossy(&output.stderr).contains("oops"));

    let mut wc = spdy(&["exec", "-i", "shell-0", "--", "wc", "-c"]);
    wc.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut wc = wc.spawn().unwrap();
    let mut stdin = wc.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, &vec![b'y'; 200_000])
        .await
        .unwrap();
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(60), wc.wait_with_output())
        .await
        .expect("exec -i over SPDY ends once its stdin does")
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), "200000");

    let local = setup.home.path().join("payload.bin");
    let payload: Vec<u8> = (0..500_000u32).map(|i| (i % 249) as u8).collect();
    std::fs::write(&local, &payload).unwrap();
    let inside = pod_dir.path().join("copied.bin");
    let back = setup.home.path().join("back.bin");
    for (from, to) in [
        (
            local.display().to_string(),
            format!("default/shell-0:{}", inside.display()),
        ),
        (
            format!("default/shell-0:{}", inside.display()),
            back.display().to_string(),
        ),
    ] {
        let output =
            tokio::time::timeout(Duration::from_secs(60), spdy(&["cp", &from, &to]).output())
                .await
                .unwrap()
                .unwrap();
        assert!(output.status.success(), "cp {from} {to}: {output:?}");
    }
    assert!(
        std::fs::read(&inside).unwrap() == payload,
        "copied in differs"
    );
    assert!(
        std::fs::read(&back).unwrap() == payload,
        "copied out differs"
    );
}

/// `kubectl attach` over both transports: the container's output from
/// now on, until the pod goes (then kubectl exits successfully).
#[tokio::test(flavor = "multi_thread")]
async fn attach_streams_the_containers_output_until_the_pod_goes() {
    if kubectl_available().await.is_none() {
        return;
    }
    let setup = Setup::start(true).await;
    let pod_dir = tempfile::tempdir().unwrap();
    let log = pod_dir.path().join("main.log");
    std::fs::write(&log, "before the attach\n").unwrap();
    for websockets in ["true", "false"] {
        shell_pod(&setup.api, pod_dir.path(), &log);
        let mut attach = setup.command(&setup.kubeconfig, &["attach", "shell-0"]);
        attach
            .env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", websockets)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut attach = attach.spawn().unwrap();
        let mut lines = BufReader::new(attach.stdout.take().unwrap()).lines();
        let seen = append_until_seen(&log, "while attached", &mut lines).await;
        assert_eq!(
            seen.as_deref(),
            Some("while attached"),
            "websockets={websockets}"
        );
        setup.api.kubelet().remove("default", "shell-0").unwrap();
        let output = tokio::time::timeout(Duration::from_secs(30), attach.wait_with_output())
            .await
            .expect("attach ends with the pod")
            .unwrap();
        assert!(
            output.status.success(),
            "websockets={websockets}: {output:?}"
        );
    }
    // The stand-in's processes read no stdin.
    shell_pod(&setup.api, pod_dir.path(), &log);
    let refused = setup.fails(&["attach", "-i", "shell-0"]).await;
    assert!(refused.contains("takes no stdin"), "{refused}");
}

/// Appends `line` to `log` until `follower` (kubectl following it) shows
/// it, for at most 30 s: it may start following after a write. The line
/// it showed.
async fn append_until_seen(
    log: &Path,
    line: &str,
    follower: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) -> Option<String> {
    let mut appended = std::fs::OpenOptions::new().append(true).open(log).unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            writeln!(appended, "{line}").unwrap();
            tokio::select! {
                shown = follower.next_line() => break shown.unwrap(),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{line:?} not shown within 30 s"))
}
