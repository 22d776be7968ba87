"""The same bytes on every machine: the environment is installed from constraints.txt (a pip freeze of
a fresh install, `make lock`), and the sample data it generates is byte for byte what data/raw.dvc
records. CI runs this on a clean clone after its own fresh install, so two installs are compared."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from facepipe.config import load_section
from facepipe.synthetic.photos import make_sample_dataset

REPO = Path(__file__).resolve().parents[1]
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> dict[str, str]:
    """constraints.txt as {canonical name: version}; every line is a comment or an exact pin."""
    found = {}
    for number, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _PIN.match(line)
        assert match, f"constraints.txt line {number} is not NAME==VERSION: {line!r}"
        found[canonical(match[1])] = match[2]
    return found


def dvc_dir_md5(root: Path) -> tuple[str, int]:
    """What `dvc add` records for a folder (DVC 3, `hash: md5`): the md5 of the JSON list of
    {"md5", "relpath"} of every file, sorted by relpath, plus ".dir"; and the file count."""
    entries = [
        {"md5": hashlib.md5(path.read_bytes()).hexdigest(), "relpath": path.relative_to(root).as_posix()}
        for path in root.rglob("*")
        if path.is_file()
    ]
    entries.sort(key=lambda entry: entry["relpath"])
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir", len(entries)


def test_constraints_pin_every_installed_library_of_the_lock():
    """Every pinned distribution that is installed has its pinned version (the install used the lock)."""
    pinned = pins()
    assert "facepipe" not in pinned and len(pinned) > 100
    wrong = {}
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if name in pinned and dist.version != pinned[name]:
            wrong[name] = f"{dist.version} installed, {pinned[name]} pinned"
    assert not wrong, wrong


def test_sample_data_imports_only_pinned_libraries():
    """Every distribution whose code `facepipe.synthetic.photos` loads (numpy, Pillow, OpenCV, ...) is pinned,
    as are the packages whose data files it reads (matplotlib's and scikit-image's sample photos)."""
    def top_level_modules(statement: str) -> set[str]:
        code = f"import sys, json\n{statement}\nprint(json.dumps(sorted({{n.split('.')[0] for n in sys.modules}})))"
        run = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
        return set(json.loads(run.stdout))

    # less what a bare interpreter has loaded (site hooks such as setuptools' _distutils_hack)
    modules = top_level_modules("import facepipe.synthetic.photos") - top_level_modules("pass")
    owners = metadata.packages_distributions()
    used = {canonical(dist) for module in modules for dist in owners.get(module, [])} - {"facepipe"}
    used |= {"matplotlib", "scikit-image"}
    pinned = pins()
    assert {"numpy", "pillow", "opencv-python-headless"} <= used
    assert not used - set(pinned), f"not pinned in constraints.txt: {sorted(used - set(pinned))}"


def test_dvc_dir_md5_is_what_dvc_computes(tmp_path):
    """The hash function below against DVC itself on a small folder."""
    raw = tmp_path / "repo" / "raw"
    (raw / "b").mkdir(parents=True)
    (raw / "a.txt").write_text("a\n")
    (raw / "b" / "c.bin").write_bytes(bytes(range(256)))
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    dvc = Path(sys.executable).with_name("dvc")
    subprocess.run([str(dvc), "init", "--no-scm", "-q"], cwd=raw.parent, check=True, env=env)
    subprocess.run([str(dvc), "add", "-q", "raw"], cwd=raw.parent, check=True, env=env)
    out = yaml.safe_load((raw.parent / "raw.dvc").read_text())["outs"][0]
    assert (out["md5"], out["nfiles"]) == dvc_dir_md5(raw)


@pytest.fixture(scope="module")
def sample_raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = tmp_path_factory.mktemp("sample") / "raw"
    make_sample_dataset(raw, load_section(REPO / "params.yaml", "sample_data"))
    return raw


@pytest.mark.slow
def test_the_sample_data_of_this_install_is_what_data_raw_dvc_records(sample_raw):
    """`facepipe sample-data` with params.yaml gives exactly the committed data/raw.dvc (the folder
    `make demo` then prepares, whose results dvc.lock records), on any CPU (README: Reproducibility)."""
    recorded = yaml.safe_load((REPO / "data" / "raw.dvc").read_text())["outs"][0]
    assert dvc_dir_md5(sample_raw) == (recorded["md5"], recorded["nfiles"])


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_prepare_and_split_of_the_sample_data_give_the_committed_lineage_where_bytes_are_promised(
    sample_raw, tmp_path
):
    """What the README promises across machines, against the committed dvc.lock: prepare's decisions
    (labels.json, hence every accepted file's identity; the split that only labels feed) are the same
    bytes on any CPU. The aligned pixels, so the shard files and the manifest's shard hashes, are not
    promised (detection and alignment kernels depend on the CPU) and are not compared."""
    from facepipe.stages import prepare, split

    lock = yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]
    split_deps = {dep["path"]: dep for dep in lock["split"]["deps"]}
    report = prepare.run(
        load_section(REPO / "params.yaml", "prepare"), sample_raw, tmp_path / "prepared", workers=2, progress=False
    )
    assert _md5(tmp_path / "prepared" / "labels.json") == split_deps["data/prepared/labels.json"]["md5"]
    counts = report["counts"]
    assert (counts["scanned"], counts["accepted"], counts["rejected"]) == (327, 320, 7)  # RetinaFace: every good photo
    split.run(load_section(REPO / "params.yaml", "split"), tmp_path / "prepared", tmp_path / "split")
    recorded = lock["split"]["outs"][0]
    assert dvc_dir_md5(tmp_path / "split") == (recorded["md5"], recorded["nfiles"])
