//! `refgen`: writes the book's generated reference pages
//! (`cargo run -p cluster-proxy-refgen`); `--check` only reports stale ones.
#![forbid(unsafe_code)]

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let check = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--check") => true,
        Some(other) => anyhow::bail!("unknown argument {other:?} (usage: refgen [--check])"),
    };
    let root = cluster_proxy_refgen::repository_root();
    let mut stale = Vec::new();
    for page in cluster_proxy_refgen::pages() {
        let path = root.join(page.path);
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current == page.text {
            continue;
        }
        if check {
            stale.push(page.path);
        } else {
            std::fs::write(&path, &page.text)
                .with_context(|| format!("writing {}", path.display()))?;
            println!("wrote {}", page.path);
        }
    }
    if !stale.is_empty() {
        anyhow::bail!(
            "stale: {} (run: cargo run -p cluster-proxy-refgen)",
            stale.join(", ")
        );
    }
    Ok(())
}
