"""Bridges from other libraries to fastattn's kernels.

``fastattn.integrations.transformers`` registers fastattn as an attention
implementation of Hugging Face transformers (``pip install 'fastattn[transformers]'``).
Nothing here is imported by ``import fastattn``: torch and transformers stay optional.
"""
