"""Runs the Python code blocks of every Markdown page while the site builds.

The blocks of a page run in order in one namespace (a block may use what an
earlier one of its page made), in a temporary directory, so that an example
that no longer runs fails the build instead of misleading a reader.  A
block that imports torch, transformers or ray runs where they are installed
and is noted as skipped elsewhere.
"""
import importlib.util
import os
import re
import tempfile

from sphinx.util import logging

logger = logging.getLogger(__name__)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
OPTIONAL = ("torch", "transformers", "ray")


def run_page(app, docname, source):
    if not app.env.doc2path(docname).suffix == ".md":
        return
    blocks = BLOCK.findall(source[0])
    if not blocks:
        return
    namespace = {"__name__": f"docs:{docname}"}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            for i, block in enumerate(blocks, 1):
                needs = [m for m in OPTIONAL if re.search(rf"\bimport {m}\b", block)]
                absent = [m for m in needs if importlib.util.find_spec(m) is None]
                if absent:
                    logger.info(f"{docname}: python block {i} not run ({', '.join(absent)} "
                                "not installed)")
                    continue
                try:
                    exec(compile(block, f"{docname}.md, python block {i}", "exec"), namespace)
                except Exception as e:  # a warning: sphinx-build -W fails on it
                    logger.warning(f"python block {i} raised {type(e).__name__}: {e}\n{block}",
                                   location=docname)
                    return
        finally:
            os.chdir(here)


def setup(app):
    app.connect("source-read", run_page)
    return {"version": "1", "parallel_read_safe": True}
