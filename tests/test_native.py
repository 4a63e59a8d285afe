"""model/native.py: building a native library, what a failed build says, and the file written whole."""

from pathlib import Path

from kvbench.model.native import compile_library


def _compiler(tmp_path: Path, script: str) -> str:
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n" + script)
    cc.chmod(0o755)
    return str(cc)


def test_a_failed_build_says_its_first_error_line_or_first_line_or_exit_status(tmp_path):
    src, out = tmp_path / "k.c", tmp_path / "lib" / "libk.so"
    src.write_text("int f(void) { return 1; }\n")
    cases = [
        ("echo 'k.c: In function f:' >&2\necho 'k.c:1: error: bad' >&2\nexit 1\n", "k.c:1: error: bad"),
        ("printf '\\n  note: first\\nnote: second\\n' >&2\nexit 1\n", "note: first"),  # no error line: the first
        ("exit 3\n", "exit status 3"),
    ]
    for script, said in cases:
        cc = _compiler(tmp_path, script)
        assert compile_library(cc, src, out, [], [], timeout=30) == f"{cc} failed to build k.c: {said}"
        assert not out.exists()  # nothing at the path a later run loads


def test_a_build_writes_beside_then_renames(tmp_path):
    """The compiler writes where it is told (-o): a hidden file beside the library, renamed once whole."""
    src, out = tmp_path / "k.c", tmp_path / "lib" / "libk.so"
    src.write_text("")
    cc = _compiler(tmp_path, 'for a; do [ "$prev" = -o ] && echo built > "$a"; prev=$a; done\n')
    assert compile_library(cc, src, out, ["-O2"], ["-lm"], timeout=30) == ""
    assert out.read_text() == "built\n" and [p.name for p in out.parent.iterdir()] == ["libk.so"]
