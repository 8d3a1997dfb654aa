"""Sphinx configuration of fastattn's documentation.

    pip install -r docs/requirements.txt && sphinx-build -W -b html docs docs/_build/html

The pages are Markdown (MyST); the API reference is generated from the
docstrings (autodoc, autosummary, numpydoc).  Every Python block of a page
runs while the site builds (_ext/run_examples.py), and the figures are
drawn then from the benchmark records (matplotlib's plot directive).  No
page is fetched from the network: intersphinx reads the inventories of the
NumPy and PyTorch names the docs cite from _inv/ (see _inv/README.md).
"""
import importlib.util
import os
import sys
from importlib.metadata import version as _version

# the installed fastattn, never the source tree's (which has no compiled
# extension): python -m sphinx puts the working directory first
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _root]
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))


def _import_transformers_backend():
    """Import fastattn.integrations.transformers over Sphinx's mock modules
    where torch or transformers is missing, so that autosummary documents it
    from its docstrings.

    docs/requirements.txt leaves both out: PyPI's torch is a CUDA build of
    several GB on Linux x86-64.  The module checks transformers' version by
    the parameters of masking_utils.sdpa_mask, given here as 5.24's.  The
    mocks leave sys.modules afterwards: the guide's torch examples are then
    skipped (_ext/run_examples.py), not run against them.
    """
    if all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers")):
        return
    from sphinx.ext.autodoc.mock import mock
    with mock(["torch", "transformers"]):
        import transformers.masking_utils

        def sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, **kwargs):
            raise NotImplementedError

        transformers.masking_utils.sdpa_mask = sdpa_mask
        import fastattn.integrations.transformers  # noqa: F401  (kept in sys.modules)


_import_transformers_backend()

project = "fastattn"
author = "the fastattn developers"
copyright = "2026, the fastattn developers"
release = _version("fastattn")  # the installed package's: pyproject.toml's version
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "numpydoc",
    "matplotlib.sphinxext.plot_directive",
    "run_examples",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_inv/README.md", "requirements.txt"]
myst_heading_anchors = 3

autosummary_generate = True
templates_path = ["_templates"]  # autosummary/class.rst: methods in full, linked
autodoc_member_order = "bysource"
autodoc_typehints = "none"   # the docstrings give shapes and dtypes, numpydoc style
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
# types stay text: the docstrings' types are shapes and dtypes in words
numpydoc_xref_param_type = False

intersphinx_mapping = {
    "numpy": ("https://numpy.org/doc/stable/", "_inv/numpy.inv"),
    "torch": ("https://docs.pytorch.org/docs/stable/", "_inv/torch.inv"),
}

plot_basedir = os.path.dirname(os.path.abspath(__file__))  # plot:: paths from docs/
plot_include_source = False
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]

html_theme = "pydata_sphinx_theme"
html_title = f"fastattn {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    # the left sidebar only where a page has pages under it (the API
    # reference): elsewhere it was an empty "Section Navigation"
    "sidebar_includehidden": False,
    # the API table needs the whole width; it has one section to jump to
    "secondary_sidebar_items": {"**": ["page-toc", "sourcelink"], "guide/api": []},
}
html_static_path = ["_static"]
html_css_files = ["fastattn.css"]  # a wider text column (see the file)
