#!/usr/bin/env python3
"""Finds module import circles in the workspace crates' `src/`.

A circle is a set of modules of one crate target where each reaches every
other through `use` declarations and `crate::`/`super::`/`self::` paths (or a
child module's name, in the module that declares it). Declaring a child
(`mod child;`) is not an edge: a child that uses its parent's items is a
tree, not a circle. `#[cfg(test)]` modules are left out (test code using the
module it tests is normal), and so are comments, doc comments (intra-doc
links are no dependency) and string literals.

Inline `mod x { ... }` blocks belong to their file's module: a reference from
inside one counts for the file, resolved from where it is written.

    python3 .ci/module_cycles.py             # the workspace; exit 1 on any circle
    python3 .ci/module_cycles.py --self-test # synthetic crates: a 2-circle, a 3-circle, a tree

Standard library only. Crates come from `cargo metadata`, or, without cargo,
from the Cargo.toml files under the workspace (`fuzz/` is skipped: it is
outside the workspace).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

IDENT = r"(?:r#)?[A-Za-z_][A-Za-z0-9_]*"


# --- lexing -----------------------------------------------------------------


def strip_comments_and_strings(text: str) -> str:
    """`text` with comments and the insides of string and char literals blanked
    out (newlines kept, so line numbers stay right)."""
    out: list[str] = []
    i, n = 0, len(text)

    def blank(segment: str) -> str:
        return "".join("\n" if c == "\n" else " " for c in segment)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(text[i:end]))
            i = end
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif c in "rb" and re.match(r'(?:br|r)#*"', text[i:i + 260]) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            m = re.match(r'(?:br|r)(#*)"', text[i:])
            assert m
            hashes = m.group(1)
            close = '"' + hashes
            end = text.find(close, i + m.end())
            end = n if end < 0 else end + len(close)
            out.append('""' + blank(text[i + 2:end]))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + blank(text[i + 1:j]) + '"')
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}', '"'), or a lifetime ('a).
            m = re.match(r"'(?:\\(?:u\{[0-9a-fA-F]*\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", text[i:])
            if m:
                out.append("' '" + blank(text[i + 3:i + m.end()]))
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    """The index just past the `}` that closes the `{` at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


# --- the module tree --------------------------------------------------------


@dataclass
class Module:
    path: tuple[str, ...]  # () is the crate root
    file: Path
    # The text with comments, strings and `#[cfg(test)]` modules blanked.
    text: str = ""
    # Inline modules of this file: (start, end, path relative to the file's module).
    inline: list[tuple[int, int, tuple[str, ...]]] = field(default_factory=list)
    children: set[str] = field(default_factory=set)


ATTRS = r"(?P<attrs>(?:\#\s*\[[^\]]*\]\s*)*)"
VIS = r"(?:pub(?:\s*\([^)]*\))?\s+)?"
MOD_DECL = re.compile(ATTRS + VIS + r"\bmod\s+(?P<name>" + IDENT + r")\s*(?P<end>[;{])")


def is_test_only(attrs: str) -> bool:
    return re.search(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", attrs) is not None


def path_attr(attrs: str, raw: str) -> str | None:
    # The attribute's string was blanked; take it from the raw text.
    m = re.search(r'#\s*\[\s*path\s*=\s*"([^"]*)"\s*\]', raw)
    return m.group(1) if m and "path" in attrs else None


def child_file(parent: Module, is_mod_rs: bool, name: str) -> Path | None:
    base = parent.file.parent if is_mod_rs else parent.file.with_suffix("")
    for candidate in (base / f"{name}.rs", base / name / "mod.rs"):
        if candidate.is_file():
            return candidate
    return None


def load_crate(root_file: Path) -> dict[tuple[str, ...], Module]:
    """Every module of the crate target whose root is `root_file`, by path."""
    modules: dict[tuple[str, ...], Module] = {}

    def load(path: tuple[str, ...], file: Path, owns_dir: bool) -> None:
        raw = file.read_text(encoding="utf-8")
        text = strip_comments_and_strings(raw)
        module = Module(path=path, file=file)
        modules[path] = module
        declared: list[tuple[str, Path]] = []
        # Inline modules nest: a stack of (end, relative path).
        pos = 0
        stack: list[tuple[int, tuple[str, ...]]] = []
        chars = list(text)
        for m in MOD_DECL.finditer(text):
            if m.start() < pos:
                continue  # inside a test module blanked below
            while stack and stack[-1][0] <= m.start():
                stack.pop()
            relative = stack[-1][1] if stack else ()
            name = m.group("name").removeprefix("r#")
            attrs = m.group("attrs") or ""
            if m.group("end") == "{":
                open_at = m.end() - 1
                end = matching_brace(text, open_at)
                if is_test_only(attrs):
                    for j in range(m.start(), end):
                        if chars[j] != "\n":
                            chars[j] = " "
                    pos = end
                    continue
                module.inline.append((open_at, end, relative + (name,)))
                stack.append((end, relative + (name,)))
            else:
                if is_test_only(attrs):
                    continue
                explicit = path_attr(attrs, raw[m.start():m.end()])
                if explicit is not None:
                    target = file.parent / explicit
                elif relative:
                    # `mod x;` inside `mod inner { }`: x lives in inner/.
                    base = file.parent if owns_dir else file.with_suffix("")
                    target = base.joinpath(*relative) / f"{name}.rs"
                    if not target.is_file():
                        target = base.joinpath(*relative, name, "mod.rs")
                else:
                    target = child_file(module, owns_dir, name)
                if target is None or not target.is_file():
                    continue  # generated or missing; nothing to follow
                if not relative:
                    module.children.add(name)
                declared.append((relative + (name,), target))
        module.text = "".join(chars)
        for relative, target in declared:
            owns = target.name == "mod.rs"
            load(path + relative, target, owns)

    load((), root_file, True)
    return modules


# --- references -------------------------------------------------------------

USE_DECL = re.compile(r"\buse\s+(?P<tree>[^;]*);")
PATH_REF = re.compile(r"(?<![A-Za-z0-9_:])(?P<path>(?:crate|super|self)(?:\s*::\s*" + IDENT + r")+)")


def expand_use_tree(tree: str) -> list[list[str]]:
    """`a::{b, c::{d, self}}` → [[a, b], [a, c, d], [a, c]] (a glob drops
    its `*`). Renames (`x as y`) must be removed first: whitespace goes here."""
    tree = re.sub(r"\s+", "", tree)
    if tree.startswith("::"):
        tree = tree[2:]

    def parse(s: str, prefix: list[str]) -> list[list[str]]:
        results: list[list[str]] = []
        for part in split_top(s):
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0:
                head = [x for x in part[:brace].split("::") if x]
                inner = part[brace + 1:part.rfind("}")]
                results.extend(parse(inner, prefix + head))
                continue
            segments = [x for x in part.split("::") if x]
            if segments and segments[-1] == "self":
                segments = segments[:-1]
            if segments and segments[-1] == "*":
                segments = segments[:-1]
            results.append(prefix + segments)
        return results

    return parse(tree, [])


def split_top(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


@dataclass(frozen=True)
class Edge:
    source: tuple[str, ...]
    target: tuple[str, ...]
    file: Path
    line: int
    text: str


def resolve(
    here: tuple[str, ...],
    segments: list[str],
    known: set[tuple[str, ...]],
    children: set[str],
) -> tuple[str, ...] | None:
    """The module `segments`, written in module `here`, points into (the
    longest prefix that is a module), or None for other crates and std."""
    if not segments:
        return None
    first = segments[0].removeprefix("r#")
    if first == "crate":
        base: tuple[str, ...] = ()
        rest = segments[1:]
    elif first in ("self", "super"):
        base = here
        rest = segments
        while rest and rest[0] in ("self", "super"):
            if rest[0] == "super":
                if not base:
                    return None
                base = base[:-1]
            rest = rest[1:]
    elif first in children:
        base, rest = here, segments
    else:
        return None
    best = base
    current = base
    for seg in rest:
        current = current + (seg.removeprefix("r#"),)
        if current in known:
            best = current
        else:
            break
    return best


def collect_edges(modules: dict[tuple[str, ...], Module]) -> list[Edge]:
    known: set[tuple[str, ...]] = set(modules)
    for module in modules.values():
        for _, _, rel in module.inline:
            known.add(module.path + rel)

    def owner(path: tuple[str, ...]) -> tuple[str, ...]:
        while path not in modules:
            path = path[:-1]
        return path

    def children_of(path: tuple[str, ...]) -> set[str]:
        return {p[-1] for p in known if len(p) == len(path) + 1 and p[:-1] == path}

    edges: list[Edge] = []
    for module in modules.values():
        text = module.text

        def scope(at: int) -> tuple[str, ...]:
            relative: tuple[str, ...] = ()
            for start, end, rel in module.inline:
                if start <= at < end and len(rel) > len(relative):
                    relative = rel
            return module.path + relative

        def add(at: int, segments: list[str], snippet: str) -> None:
            here = scope(at)
            target = resolve(here, segments, known, children_of(here))
            if target is None:
                return
            target = owner(target)
            if target == module.path:
                return
            line = text.count("\n", 0, at) + 1
            edges.append(Edge(module.path, target, module.file, line, " ".join(snippet.split())))

        use_spans: list[tuple[int, int]] = []
        for m in USE_DECL.finditer(text):
            use_spans.append((m.start(), m.end()))
            tree = re.sub(r"\s+as\s+" + IDENT, "", m.group("tree"))
            for segments in expand_use_tree(tree):
                add(m.start(), segments, m.group(0))
        for m in PATH_REF.finditer(text):
            if any(s <= m.start() < e for s, e in use_spans):
                continue
            segments = [s.strip() for s in m.group("path").split("::")]
            add(m.start(), segments, m.group("path"))
        # A child module's name used as a path (`child::item`) in the module
        # that declares it, outside `use` declarations (handled above).
        if module.children:
            names = "|".join(re.escape(c) for c in sorted(module.children))
            for m in re.finditer(r"(?<![A-Za-z0-9_:])(" + names + r")\s*::\s*" + IDENT, text):
                if any(s <= m.start() < e for s, e in use_spans):
                    continue
                if scope(m.start()) != module.path:
                    continue
                add(m.start(), [m.group(1), "x"], m.group(0))
    return edges


# --- strongly connected components ------------------------------------------


def cycles(edges: list[Edge]) -> list[list[tuple[str, ...]]]:
    graph: dict[tuple[str, ...], set[tuple[str, ...]]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[tuple[str, ...], int] = {}
    low: dict[tuple[str, ...], int] = {}
    on_stack: set[tuple[str, ...]] = set()
    stack: list[tuple[str, ...]] = []
    found: list[list[tuple[str, ...]]] = []
    counter = 0
    # Iterative Tarjan: module graphs are small, but recursion limits are not
    # worth the risk.
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for succ in it:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def name(path: tuple[str, ...]) -> str:
    return "::".join(("crate",) + path)


def check_target(label: str, root_file: Path, out=sys.stdout) -> list[str]:
    """Prints the circles of one crate target; returns each as a one-line key
    (`<target label>: <module>, <module>, ...`), as a --known file lists them."""
    modules = load_crate(root_file)
    edges = collect_edges(modules)
    found = cycles(edges)
    for component in found:
        members = set(component)
        print(f"{label}: circle of {len(component)} modules: {', '.join(name(m) for m in component)}", file=out)
        first: dict[tuple[tuple[str, ...], tuple[str, ...]], Edge] = {}
        for e in edges:
            if e.source in members and e.target in members:
                first.setdefault((e.source, e.target), e)
        for (src, dst), e in sorted(first.items()):
            rel = os.path.relpath(e.file, ROOT) if e.file.is_relative_to(ROOT) else e.file
            print(f"    {name(src)} -> {name(dst)}  ({rel}:{e.line}: {e.text[:100]})", file=out)
    return [f"{label}: {', '.join(name(m) for m in component)}" for component in found]


def read_known(path: Path) -> set[str]:
    """The circles a --known file accepts for now: one key a line, `#` comments."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


# --- crates -----------------------------------------------------------------


def workspace_targets(root: Path) -> list[tuple[str, Path]]:
    """(label, root file) of every lib and bin target under a crate's `src/`."""
    try:
        meta = json.loads(
            subprocess.run(
                ["cargo", "metadata", "--no-deps", "--format-version", "1"],
                cwd=root,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        targets = []
        for package in meta["packages"]:
            src = Path(package["manifest_path"]).parent / "src"
            for target in package["targets"]:
                path = Path(target["src_path"])
                if "fuzz" in path.relative_to(root).parts[:1]:
                    continue
                if path.is_relative_to(src) and ({"lib", "bin", "proc-macro"} & set(target["kind"]) or
                                                 any(k.endswith("lib") for k in target["kind"])):
                    targets.append((f"{package['name']} ({target['name']})", path))
        return sorted(targets)
    except (OSError, subprocess.CalledProcessError, KeyError, ValueError):
        return walked_targets(root)


def walked_targets(root: Path) -> list[tuple[str, Path]]:
    targets = []
    for manifest in sorted(root.rglob("Cargo.toml")):
        rel = manifest.relative_to(root).parts
        if rel[0] in ("fuzz", "target") or any(p.startswith(".") for p in rel):
            continue
        m = re.search(r'^\s*name\s*=\s*"([^"]+)"', manifest.read_text(encoding="utf-8"), re.M)
        crate = m.group(1) if m else manifest.parent.name
        src = manifest.parent / "src"
        for file in [src / "lib.rs", src / "main.rs", *sorted((src / "bin").glob("*.rs"))]:
            if file.is_file():
                targets.append((f"{crate} ({file.relative_to(src)})", file))
    return targets


# --- self-test --------------------------------------------------------------


def self_test() -> int:
    cases = {
        # a uses b, b uses a.
        "two": ({
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::B;\npub struct A;\n",
            "b.rs": "pub struct B;\npub fn f() -> crate::a::A { crate::a::A }\n",
        }, 1),
        # a → b → c → a, through super:: and a nested `use` tree.
        "three": ({
            "lib.rs": "mod a;\nmod b;\nmod c;\n",
            "a.rs": "use super::{b::{self, B}};\npub struct A;\n",
            "b.rs": "pub struct B;\nfn g() { let _ = super::c::C; }\n",
            "c.rs": "pub struct C;\n// crate::b::B in a comment is no edge\nuse crate::a::A as Renamed;\n",
        }, 1),
        # A tree: children use their parent's items, the parent declares
        # them, and a test module uses the parent; strings and doc links are
        # no edges; an inline module's `super::` is resolved from inside it.
        "tree": ({
            "lib.rs": "//! [`crate::net::Conn`]\nmod net;\nmod error;\npub use error::Error;\n",
            "error.rs": "pub struct Error;\n",
            "net/mod.rs": "mod conn;\nuse crate::error::Error;\npub struct Net;\n"
                          "#[cfg(test)]\nmod tests {\n    use super::conn::Conn;\n}\n",
            "net/conn.rs": "use super::Net;\nuse crate::error::Error;\n"
                           "const S: &str = \"crate::net::conn\";\n"
                           "mod inner { use super::super::Net; }\n",
        }, 0),
    }
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for case, (files, expected) in cases.items():
            src = Path(tmp) / case / "src"
            for rel, body in files.items():
                (src / rel).parent.mkdir(parents=True, exist_ok=True)
                (src / rel).write_text(body, encoding="utf-8")
            (Path(tmp) / case / "Cargo.toml").write_text(f'[package]\nname = "{case}"\n', encoding="utf-8")
            found = cycles(collect_edges(load_crate(src / "lib.rs")))
            sizes = sorted(len(c) for c in found)
            want = {"two": [2], "three": [3], "tree": []}[case]
            ok = len(found) == expected and sizes == want
            print(f"self-test {case}: {'ok' if ok else 'FAILED'} (circles of sizes {sizes}, expected {want})")
            failures += 0 if ok else 1
        # The same crates found by walking Cargo.toml files.
        walked = {label.split(" ")[0] for label, _ in walked_targets(Path(tmp))}
        ok = walked == set(cases)
        print(f"self-test walking Cargo.toml: {'ok' if ok else 'FAILED'} ({sorted(walked)})")
        failures += 0 if ok else 1
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args == ["--self-test"]:
        return self_test()
    known: set[str] = set()
    if len(args) == 2 and args[0] == "--known":
        known = read_known(Path(args[1]))
    elif args:
        print(__doc__, file=sys.stderr)
        return 2
    found: list[str] = []
    targets = workspace_targets(ROOT)
    for label, root_file in targets:
        found.extend(check_target(label, root_file))
    new = [key for key in found if key not in known]
    gone = sorted(known - set(found))
    print(f"{len(found)} module circle(s) in {len(targets)} crate targets, {len(found) - len(new)} of them known")
    for key in new:
        print(f"NEW circle (open it; do not add it to the known list): {key}")
    for key in gone:
        print(f"no longer a circle, remove it from the known list: {key}")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
