#!/usr/bin/env python3
"""Compares the SASS of every kernel in two builds: a change meant to leave the kernels alone
(host code, file moves, comments) must leave each kernel's instructions identical.

  scripts/compare_sass.py [--ignore-params] OLD NEW [NAME_PART ...]

OLD and NEW are libfa4.so files, object files, or build directories (every *.o under
CMakeFiles/ is read). Kernels are matched by mangled name, with the per-file hash of an anonymous
namespace removed (it follows the source file's path); NAME_PART limits the comparison to kernels
whose names contain one of them. Needs cuobjdump (the CUDA toolkit's, or the copy Triton ships).
Exits 0 when the two have the same kernels with the same instructions, 1 otherwise.

--ignore-params: a kernel's parameter struct that gains fields (a descriptor the default path does
not use) moves the constant-bank offsets its instructions read (c[0x0][...]); those are compared
as equal, and each kernel still different prints its differing instructions (at most 12), for
the rest to be read by eye (an immediate that addresses a parameter moves too).
"""
import difflib
import pathlib
import re
import shutil
import subprocess
import sys

_ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")
_PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_ADDRESS = re.compile(r"^/\*[0-9a-f]+\*/\s*")
_ENCODING = re.compile(r"\s*/\* 0x[0-9a-f]+ \*/$")


def cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton  # its NVIDIA backend ships the tool
        candidate = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    sys.exit("compare_sass: cuobjdump not found (the CUDA toolkit's bin, or pip's triton)")


def binaries(path):
    p = pathlib.Path(path)
    if p.is_dir():
        return sorted(p.glob("CMakeFiles/**/*.o"))
    return [p]


def kernels(path, tool):
    """{normalised kernel name: its instructions, one per line, addresses included}."""
    funcs = {}
    for binary in binaries(path):
        out = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True).stdout
        name, body = None, []
        for line in out.splitlines() + ["Function : <end>"]:
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                if name is not None:
                    funcs[name] = "\n".join(body)
                name, body = _ANONYMOUS.sub("_GLOBAL__N_", m.group(1)), []
            elif name is not None and "/*" in line:
                body.append(line.strip())
    return funcs


def without_params(body):
    """The instructions with parameter offsets, addresses and encodings left out."""
    lines = (_ENCODING.sub("", _ADDRESS.sub("", line)) for line in body.splitlines())
    return [_PARAM.sub("c[0x0][param]", line) for line in lines if line]


def main(argv):
    ignore_params = "--ignore-params" in argv
    argv = [a for a in argv if a != "--ignore-params"]
    if len(argv) < 3:
        sys.exit(__doc__)
    tool = cuobjdump()
    old, new, parts = kernels(argv[1], tool), kernels(argv[2], tool), argv[3:]
    keep = (lambda n: any(part in n for part in parts)) if parts else (lambda n: True)
    old = {n: s for n, s in old.items() if keep(n)}
    new = {n: s for n, s in new.items() if keep(n)}
    problems = ["only in %s: %s" % (argv[1], n) for n in sorted(old.keys() - new.keys())]
    problems += ["only in %s: %s" % (argv[2], n) for n in sorted(new.keys() - old.keys())]
    same = 0
    for n in sorted(old.keys() & new.keys()):
        if old[n] == new[n]:
            same += 1
        elif ignore_params and without_params(old[n]) == without_params(new[n]):
            same += 1
        else:
            problems.append("different: %s (%d / %d instructions)"
                            % (n, len(old[n].splitlines()), len(new[n].splitlines())))
            if ignore_params:
                diff = [d for d in difflib.unified_diff(without_params(old[n]),
                                                        without_params(new[n]), lineterm="", n=0)
                        if d[:1] in "+-" and d[:3] not in ("+++", "---")]
                problems += ["    " + d for d in diff[:12]]
    for line in problems:
        print(line)
    differences = sum(1 for line in problems if not line.startswith("    "))
    print("%d kernels identical, %d differences" % (same, differences))
    return 0 if not problems and same > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
