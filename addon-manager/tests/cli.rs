//! The `addon-manager` binary as an operator meets it: bad settings and a
//! missing Kubernetes API give a clear error and a non-zero exit, never a
//! panic or a hang.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_addon-manager");

fn run(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("HOME", "/nonexistent");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("running addon-manager");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn an_invalid_namespace_names_the_setting() {
    let (ok, said) = run(&["--namespace=Not_A_Label"], &[]);
    assert!(!ok, "{said}");
    assert!(said.contains("namespace"), "{said}");
    assert!(!said.contains("panicked"), "{said}");
}

#[test]
fn an_unknown_environment_variable_is_named() {
    let (ok, said) = run(&[], &[("ADDON_MANAGER_HEALTH_PORT", "many")]);
    assert!(!ok, "{said}");
    assert!(said.contains("ADDON_MANAGER_HEALTH_PORT"), "{said}");
}

#[test]
fn without_a_kubernetes_api_it_says_so() {
    let (ok, said) = run(&["--health-port=0"], &[]);
    assert!(!ok, "{said}");
    assert!(said.contains("no Kubernetes API"), "{said}");
    assert!(!said.contains("panicked"), "{said}");
}

#[test]
fn help_and_version_answer() {
    let (ok, said) = run(&["--help"], &[]);
    assert!(ok, "{said}");
    assert!(said.contains("--agent-install-namespace"), "{said}");
    assert!(said.contains("[default: 58081]"), "{said}");
    let (ok, said) = run(&["--version"], &[]);
    assert!(ok, "{said}");
    assert!(said.starts_with("addon-manager "), "{said}");
}
