"""Verification kernels of the speculative decoding step (installed as `tandem.kernels`).

Each step verifies up to K drafts per request row b; entries past num_drafts[b] are padding and
num_drafts[b] = 0 is a plain decoding step. Both functions return

- output_ids [B, K+1] int64: the row's committed tokens, i.e. its accepted drafts, then exactly one
  recovered token (at the first rejection) or bonus token (after every draft was accepted), then -1;
- num_accepted [B] int64: accepted drafts per row; committed tokens = num_accepted + 1.

`greedy_accept` accepts a draft while it equals the target's argmax. `rejection_sample` is lossless
speculative sampling (Leviathan et al. 2023): a draft x is accepted iff q(x) > 0 and
p(x) / q(x) >= uniform, the recovered token is drawn from norm(max(0, p - q)) and the bonus token
from p, both by the exponential race argmax_v w_v / exp_noise_v (lowest index on ties). All
randomness is an input, so a seeded generator makes a step reproducible on any device.

Token trees (several drafts per position, sharing prefixes): `tree_greedy_accept` and
`tree_rejection_sample` take each node's parent beside its token (-1: the pending token) and also
return the accepted path's node indices [B, K] (-1 after), so the caller keeps exactly that path's
KV. Sampled trees take deterministic drafts only (one-hot q), verified by recursive rejection over
siblings (reference.tree_rejection_sample); a chain given as a tree gets `rejection_sample`'s result.

Dispatch: CUDA tensors run the Triton kernels (`triton_verify`), CPU tensors the PyTorch reference
(`reference`), which defines the semantics; the two agree bit for bit. TANDEM_FORCE_TRITON=1 sends
CPU tensors to Triton too, for tests under TRITON_INTERPRET=1. Triton is imported only on that path,
so CPU-only users need no Triton.
"""

if __name__ == "kernels":
    # This folder is the source of `tandem.kernels`. Imported under the bare name `kernels` it only
    # got here because a checkout's root is on sys.path (`python -m ...` run from it), where it would
    # shadow Hugging Face's `kernels` package, which transformers imports (5.25 and later). Hand that
    # import to the real package: the first `kernels` on sys.path outside this checkout.
    import importlib.machinery
    import importlib.util
    import sys
    from pathlib import Path

    _root = Path(__file__).resolve().parent.parent
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if Path(p or ".").resolve() != _root])
    if _spec is None:
        raise ImportError("no package named 'kernels' here: this checkout's kernels/ folder is Tandem's, "
                          "imported as tandem.kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import system returns what sys.modules holds after this runs
    _spec.loader.exec_module(_module)
else:
    from . import reference
    from .dispatch import greedy_accept, rejection_sample, tree_greedy_accept, tree_rejection_sample

    __all__ = ["greedy_accept", "rejection_sample", "tree_greedy_accept", "tree_rejection_sample", "reference"]
