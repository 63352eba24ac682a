#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time: fuzz/run.sh [seconds-per-target] [target...]
#
# The stable toolchain is enough: RUSTC_BOOTSTRAP=1 lets it take the nightly
# flags cargo-fuzz passes (-Z sanitizer coverage). cargo-fuzz is installed
# into target/tools when missing. No sanitizer (-s none): the crates under
# test forbid unsafe code, and libFuzzer still finds panics, hangs
# (-timeout) and runaway allocation (-rss_limit_mb).
#
# Seeds come from fuzz/corpus/<target>/ (checked in); what libFuzzer learns
# goes to fuzz/corpus-run/<target>/ (ignored by git); a crash lands in
# fuzz/artifacts/<target>/ and makes this script fail.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
shift || true
root="$(cd .. && pwd)"
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
tools="$CARGO_TARGET_DIR/tools"
export PATH="$tools/bin:$PATH"
if ! command -v cargo-fuzz >/dev/null; then
  cargo install cargo-fuzz --locked --version 0.13.2 --root "$tools"
fi
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
fi
cargo fuzz build -s none
for target in "${targets[@]}"; do
  mkdir -p "corpus-run/$target"
  echo "== fuzz $target for ${seconds}s"
  cargo fuzz run -s none "$target" "corpus-run/$target" "corpus/$target" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1
done
