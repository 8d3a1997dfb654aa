"""Writes numpy.inv and torch.inv: Sphinx inventories of the NumPy and
PyTorch names the docs cite, with their pages on numpy.org and
docs.pytorch.org.  The build reads these files rather than fetching the
projects' own inventories, since it may run where no docs site is
reachable (CI); a name cited from now on is added to NAMES.

    python docs/_inv/make_inventories.py     (needs sphobjinv)
"""
import os

import sphobjinv as soi

NAMES = {
    "numpy": ("NumPy", "2", [
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#numpy.ndarray"),
        ("numpy.float32", "py:attribute", "reference/arrays.scalars.html#numpy.float32"),
        ("numpy.float64", "py:attribute", "reference/arrays.scalars.html#numpy.float64"),
        ("numpy.float16", "py:attribute", "reference/arrays.scalars.html#numpy.float16"),
        ("numpy.int32", "py:attribute", "reference/arrays.scalars.html#numpy.int32"),
        ("numpy.random.Generator", "py:class",
         "reference/random/generator.html#numpy.random.Generator"),
    ]),
    "torch": ("PyTorch", "2.13", [
        ("torch.nn.functional.scaled_dot_product_attention", "py:function",
         "generated/torch.nn.functional.scaled_dot_product_attention.html"),
        ("torch.nn.MultiheadAttention", "py:class",
         "generated/torch.nn.MultiheadAttention.html"),
    ]),
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    for name, (project, version, entries) in NAMES.items():
        inv = soi.Inventory()
        inv.project, inv.version = project, version
        for obj, role, uri in entries:
            domain, kind = role.split(":")
            inv.objects.append(soi.DataObjStr(name=obj, domain=domain, role=kind, priority="1",
                                              uri=uri, dispname="-"))
        soi.writebytes(os.path.join(here, f"{name}.inv"), soi.compress(inv.data_file()))


if __name__ == "__main__":
    main()
