use std::path::PathBuf;

use anyhow::Context;
use cert_authority::files::{InitOptions, Layout, init};
use clap::{Parser, Subcommand};
use cluster_proxy_proto::duration::parse_go_duration;
use cluster_proxy_proto::identity::ClusterName;

#[derive(Parser)]
#[command(
    name = "cert-authority",
    version,
    about = "cluster-proxy PKI: issues every mTLS credential"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a complete PKI into a directory: CA and trust bundle, both
    /// proxy-server certificates, the proxy-client certificate and one agent
    /// certificate per cluster.
    Init {
        /// Directory to create the PKI in (must not hold a CA yet).
        #[arg(long)]
        dir: PathBuf,
        /// Managed clusters to issue agent certificates for (comma-separated).
        #[arg(long, value_delimiter = ',')]
        clusters: Vec<String>,
        /// Extra SAN for both server certificates (repeatable), as upstream's additionalSANs.
        #[arg(long = "additional-san")]
        additional_sans: Vec<String>,
        /// Validity of leaf certificates (Go duration).
        #[arg(long, default_value = "2160h")]
        leaf_validity: String,
        /// Validity of the CA (Go duration).
        #[arg(long, default_value = "43800h")]
        ca_validity: String,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Init {
            dir,
            clusters,
            additional_sans,
            leaf_validity,
            ca_validity,
        } => {
            let clusters = clusters
                .iter()
                .map(|c| ClusterName::new(c.trim()))
                .collect::<Result<Vec<_>, _>>()
                .context("--clusters")?;
            let options = InitOptions {
                clusters,
                additional_sans,
                leaf_validity: parse_go_duration(&leaf_validity).context("--leaf-validity")?,
                ca_validity: parse_go_duration(&ca_validity).context("--ca-validity")?,
            };
            let layout = Layout::new(&dir);
            init(&layout, &options)?;
            println!("wrote a PKI to {}:", dir.display());
            let show = |what: &str, pair: cert_authority::files::Pair| {
                println!(
                    "  {:<28} {} / {}",
                    what,
                    pair.cert.display(),
                    pair.key.display()
                );
            };
            println!("  {:<28} {}", "trust bundle", layout.bundle().display());
            show("CA (keep the key private)", layout.ca());
            show("proxy-server client port", layout.proxy_server());
            show("proxy-server agent port", layout.agent_server());
            show("hub proxy client", layout.proxy_client());
            for cluster in &options.clusters {
                show(&format!("agent of {cluster}"), layout.agent(cluster));
            }
            Ok(())
        }
    }
}
