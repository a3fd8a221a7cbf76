"""The documentation site builds with ``mkdocs build --strict`` and has every page it should.

Strict mode turns every warning into a failure: a broken link or anchor, a page missing from
the nav, a docstring the API reference cannot render.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import keras_dist as kd

ROOT = Path(__file__).resolve().parents[2]

# Each public namespace and the API page that documents its names.
API_PAGES = {
    kd: "api/keras_dist",
    kd.callbacks: "api/callbacks",
    kd.cluster_resolver: "api/cluster_resolver",
    kd.config: "api/config",
    kd.coordinator: "api/coordinator",
    kd.data: "api/data",
    kd.errors: "api/errors",
    kd.experimental: "api/experimental",
    kd.experimental.partitioners: "api/experimental",
    kd.layers: "api/layers",
    kd.nn: "api/nn",
    kd.testing: "api/testing",
    kd.tpu.experimental: "api/tpu",
    kd.train: "api/train",
}
# The strategy classes and their options are documented together, on the strategies page.
STRATEGY_PAGE = "api/strategies"
STRATEGY_PAGE_NAMES = {
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CollectiveHints",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "Strategy",
    "StrategyExtended",
    "TPUStrategy",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    site_dir = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return site_dir


def _nav_pages(nav):
    for entry in nav:
        for value in entry.values():
            if isinstance(value, list):
                yield from _nav_pages(value)
            else:
                yield value


def test_every_nav_page_is_built(site):
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    pages = list(_nav_pages(config["nav"]))
    assert len(pages) >= 35
    for page in pages:
        stem = re.sub(r"\.(md|ipynb)$", "", page)
        if stem == "index" or stem.endswith("/index"):
            stem = stem.removesuffix("index")
        built = site / stem / "index.html"
        assert built.exists(), f"{page} was not built"
        assert len(built.read_text()) > 2000, f"{page} is empty"


def test_api_reference_documents_every_public_name(site):
    missing = []
    for module, page in API_PAGES.items():
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type(kd)):
                continue  # a namespace: it has its own page
            page_of_name = STRATEGY_PAGE if name in STRATEGY_PAGE_NAMES else page
            text = (site / page_of_name / "index.html").read_text()
            # A name re-exported at the top (kd.MirroredStrategy) may be documented there, and
            # an alias (UnionResolver = UnionClusterResolver) under the name it aliases.
            names = {name, getattr(obj, "__name__", name)}
            ids = [f"{prefix}.{n}" for n in names for prefix in (module.__name__, "keras_dist")]
            if not any(f'id="{id_}"' in text for id_ in ids):
                missing.append(f"{module.__name__}.{name} on {page_of_name}")
    assert missing == []


def test_notebooks_are_rendered_with_their_outputs(site):
    quickstart = (site / "examples" / "quickstart" / "index.html").read_text()
    assert "4 replicas" in quickstart  # an output saved in the notebook
    assert "MirroredStrategy" in quickstart
    assert (site / "examples" / "parameter_server" / "index.html").exists()


def test_readme_says_how_to_serve_the_docs():
    assert "mkdocs serve" in (ROOT / "README.md").read_text()
