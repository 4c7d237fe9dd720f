"""The front end, the one road from every surface to the engine: user input -> engine requests,
engine outputs -> answers. It runs no model.

- :mod:`.requests`: one frozen object per operation, each per-request field defined and checked once;
- :mod:`.plans`: :class:`~.plans.Frontend` turns a request into a :class:`~.plans.Plan`;
- :mod:`.outputs`: engine outputs as arrays, classification results, rankings, quantized codes;
- :mod:`.scoring`, :mod:`.chunking`, :mod:`.quantize`, :mod:`.results`: the rules these follow.
"""
