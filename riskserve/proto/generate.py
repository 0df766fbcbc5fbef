"""Regenerate the committed Python gRPC code for riskserve's protos, or check it for drift.

    python -m riskserve.proto.generate          # rewrite the generated files
    python -m riskserve.proto.generate --check  # exit 1 if they differ from a fresh generation

protoc runs with ``-I riskserve/proto`` so the descriptor keeps its canonical file name
(``riskserve/v1/risk_pipeline.proto``, the name other languages and reflection clients see). The code
protoc writes for that include root would import ``riskserve.v1...``, which in this repository is the
wrong package, so two lines are rewritten to the real package ``riskserve.proto.riskserve.v1``:

* the ``from riskserve.v1 import ..._pb2`` imports in ``*_pb2_grpc.py`` (and ``*_pb2.py[i]`` if a proto
  imports another riskserve proto);
* the module name handed to ``BuildTopDescriptorsAndMessages`` in ``*_pb2.py``. It becomes the message
  classes' ``__module__``; left as ``riskserve.v1...``, ``pickle`` (used by Ray Serve to ship requests to
  replicas) fails with "import of module 'riskserve.v1.risk_pipeline_pb2' failed".

Every generated file also gets a ``# mypy: ignore-errors`` first line (see ``_MYPY_HEADER``).

The output depends on the grpcio-tools version (it is stamped into the files), so the check only holds for
the grpcio-tools version the committed files were generated with; see ``generator_version``.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
"""The protoc include root; ``.proto`` paths below are relative to it."""

PYTHON_PACKAGE = "riskserve.proto"
"""The importable Python package that ``PROTO_ROOT`` is."""

PROTOS: tuple[str, ...] = ("riskserve/v1/risk_pipeline.proto", "riskserve/internal/v1/model_lane.proto")

GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

_PROTO_TOP_LEVEL = "riskserve"
"""The first component of every proto package generated here (``riskserve.v1`` ...)."""

_IMPORT_RE = re.compile(
    rf"^(?P<lead>from ){_PROTO_TOP_LEVEL}(?P<rest>(?:\.\w+)* import \w+_pb2(?:_grpc)? as \w+)$", re.M
)
_BUILD_RE = re.compile(
    rf"(?P<lead>_builder\.BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')"
    rf"(?P<module>{_PROTO_TOP_LEVEL}(?:\.\w+)*_pb2)(?P<tail>', _globals\))"
)
_GRPC_VERSION_RE = re.compile(r"^GRPC_GENERATED_VERSION = '(?P<version>[^']+)'$", re.M)
_PROTOBUF_VERSION_RE = re.compile(r"^# Protobuf Python Version: (?P<version>\S+)$", re.M)

_MYPY_HEADER = "# mypy: ignore-errors\n"
"""Prepended to every generated file: protoc's output is not ``mypy --strict`` clean (untyped defs in
``_pb2_grpc.py``; bare ``Mapping`` and, without types-protobuf, subclasses of ``Any`` in ``_pb2.pyi``).
The stub's types still apply to the code that imports it."""

_INIT_TEXT = '"""Generated protobuf package; see riskserve/proto/generate.py."""\n'


class GenerationError(RuntimeError):
    """protoc failed, or its output did not have the shape the post-fixes expect."""


def _module_for(proto: str) -> str:
    """``riskserve/v1/x.proto`` -> ``riskserve.v1.x_pb2`` (what protoc calls the module)."""
    return proto.removesuffix(".proto").replace("/", ".") + "_pb2"


def _fix_imports(text: str) -> str:
    return _IMPORT_RE.sub(rf"\g<lead>{PYTHON_PACKAGE}.{_PROTO_TOP_LEVEL}\g<rest>", text)


def _postfix(relpath: str, text: str, proto: str) -> str:
    """Rewrite protoc's module paths (relative to the include root) to the real package."""
    text = _MYPY_HEADER + _fix_imports(text)
    if relpath.endswith("_pb2.py"):
        expected = _module_for(proto)
        text, count = _BUILD_RE.subn(
            lambda m: (
                f"{m['lead']}{PYTHON_PACKAGE}.{m['module']}{m['tail']}" if m["module"] == expected else m[0]
            ),
            text,
        )
        if count != 1 or f"'{PYTHON_PACKAGE}.{expected}'" not in text:
            raise GenerationError(f"{relpath}: expected one BuildTopDescriptorsAndMessages for {expected!r}")
    if relpath.endswith("_pb2_grpc.py") and f"from {PYTHON_PACKAGE}." not in text and "_pb2 as " in text:
        raise GenerationError(f"{relpath}: the import of its _pb2 module was not rewritten")
    return text


def _package_inits(relpaths: Sequence[str]) -> dict[str, str]:
    """The ``__init__.py`` every directory holding generated modules needs, up to the proto root."""
    inits: dict[str, str] = {}
    for relpath in relpaths:
        parent = Path(relpath).parent
        while parent != Path("."):
            inits[(parent / "__init__.py").as_posix()] = _INIT_TEXT
            parent = parent.parent
    return inits


def generate() -> dict[str, str]:
    """Run protoc into a temporary directory and return ``{path relative to PROTO_ROOT: text}``."""
    outputs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="riskserve-protoc-") as tmp:
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        result = subprocess.run(command, cwd=PROTO_ROOT, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise GenerationError(f"protoc failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        for proto in PROTOS:
            stem = proto.removesuffix(".proto")
            for suffix in GENERATED_SUFFIXES:
                relpath = stem + suffix
                produced = Path(tmp) / relpath
                if not produced.is_file():
                    raise GenerationError(f"protoc did not write {relpath}")
                outputs[relpath] = _postfix(relpath, produced.read_text(encoding="utf-8"), proto)
    return outputs


def committed_generated_files() -> list[str]:
    """Generated-looking files currently under ``PROTO_ROOT`` (relative paths, sorted)."""
    found = {
        path.relative_to(PROTO_ROOT).as_posix()
        for suffix in GENERATED_SUFFIXES
        for path in PROTO_ROOT.rglob(f"*{suffix}")
        if path.is_file()
    }
    return sorted(found)


def generator_version(texts: Iterable[str]) -> str:
    """The grpcio-tools / protobuf versions stamped into generated code, for drift messages."""
    text = "\n".join(texts)
    grpc_match = _GRPC_VERSION_RE.search(text)
    protobuf_match = _PROTOBUF_VERSION_RE.search(text)
    grpc_version = grpc_match["version"] if grpc_match else "?"
    protobuf_version = protobuf_match["version"] if protobuf_match else "?"
    return f"grpcio-tools {grpc_version} / protobuf gencode {protobuf_version}"


def find_drift(expected: dict[str, str]) -> list[str]:
    """Human-readable differences between ``expected`` (plus package inits) and the files on disk."""
    problems: list[str] = []
    for relpath, text in sorted(expected.items()):
        path = PROTO_ROOT / relpath
        if not path.is_file():
            problems.append(f"missing: {relpath}")
            continue
        current = path.read_text(encoding="utf-8")
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"committed/{relpath}",
                tofile=f"generated/{relpath}",
                n=1,
            )
            problems.append(f"differs: {relpath}\n" + "".join(list(diff)[:40]))
    for inits in _package_inits(list(expected)):
        if not (PROTO_ROOT / inits).is_file():
            problems.append(f"missing: {inits}")
    problems.extend(f"stale: {relpath}" for relpath in committed_generated_files() if relpath not in expected)
    return problems


def write(expected: dict[str, str]) -> list[str]:
    """Bring the files on disk in line with ``expected``; return what was done (``wrote x``, ...)."""
    changed: list[str] = []
    for relpath, text in sorted(_package_inits(list(expected)).items()):
        path = PROTO_ROOT / relpath
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(f"wrote {relpath}")
    for relpath, text in sorted(expected.items()):
        path = PROTO_ROOT / relpath
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(f"wrote {relpath}")
    for relpath in committed_generated_files():
        if relpath not in expected:
            (PROTO_ROOT / relpath).unlink()
            changed.append(f"removed stale {relpath}")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m riskserve.proto.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the committed files are out of date"
    )
    args = parser.parse_args(argv)
    try:
        expected = generate()
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        problems = find_drift(expected)
        if not problems:
            print(f"generated code is up to date ({len(expected)} files)")
            return 0
        committed_version = generator_version(
            (PROTO_ROOT / relpath).read_text(encoding="utf-8")
            for relpath in expected
            if (PROTO_ROOT / relpath).is_file()
        )
        print("generated code is out of date:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        current_version = generator_version(expected.values())
        print(
            f"committed files: {committed_version}; this environment: {current_version}\n"
            "run `python -m riskserve.proto.generate` and commit the result",
            file=sys.stderr,
        )
        return 1
    changed = write(expected)
    for action in changed:
        print(action)
    if not changed:
        print("generated code already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
