"""A few calls of every kernel for valgrind's memcheck (run by .ci/memcheck.sh).

memcheck sees what AddressSanitizer cannot: reads of scratch memory that
was never written.  Such a value only shows when something depends on it,
so every result here is compared with the NumPy reference.  Shapes are
small but cross the kernels' block edges: the row kernel (<= 4 query rows)
and the block kernel, partial query and key blocks, partial micro-tiles,
decoding with the keys split in pieces, strided, reversed and broadcast
operands, masks, GQA, every SIMD path valgrind runs (it hides AVX-512 from
the program: AddressSanitizer covers that one)."""
import numpy as np

import fastattn
from fastattn import reference as ref


def close(a, b, tol):
    if not np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True):
        raise AssertionError(f"max difference {np.nanmax(np.abs(a - b))}")


def main():
    rng = np.random.default_rng(0)
    for path in fastattn.available_simd_paths():
        fastattn.set_simd_path(path)
        for dtype, tol in ((np.float32, 1e-4), (np.float64, 1e-10)):
            def arr(*shape):
                return rng.standard_normal(shape).astype(dtype)

            for L, S in ((3, 5), (67, 133)):
                q, k, v = arr(2, 2, L, 9), arr(2, 1, S, 9), arr(1, 2, S, 7)[..., ::-1, :]
                mask = rng.random((L, S)) > 0.3
                fmask = np.where(mask, arr(L, S), -np.inf)
                for kwargs in ({"attn_mask": mask, "is_causal": True},
                               {"attn_mask": fmask, "causal_alignment": "lower_right",
                                "is_causal": True}):
                    out, w = fastattn.scaled_dot_product_attention(
                        q, k, v, need_weights=True, num_threads=2, **kwargs)
                    r_out, r_w = ref.scaled_dot_product_attention(
                        *(a.astype(np.float64) for a in (q, k, v)), need_weights=True,
                        **{n: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype != bool
                           else a for n, a in kwargs.items()})
                    close(out, r_out, tol)
                    close(w, r_w, tol)
                gq = arr(1, 4, L, 9)
                out = fastattn.scaled_dot_product_attention(gq, k[:1], v[:, :1], enable_gqa=True)
                close(out, ref.scaled_dot_product_attention(gq, k[:1], v[:, :1], enable_gqa=True),
                      tol)
            # decoding over many keys: split in pieces, merged (no weights)
            q, k, v = arr(1, 2, 2, 16), arr(1, 2, 2100, 16), arr(1, 2, 2100, 8)
            mask = rng.random(2100) > 0.2
            close(fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                  ref.scaled_dot_product_attention(q, k, v, attn_mask=mask), tol)
            a, b = arr(2, 13, 70), arr(70, 23)
            close(fastattn.matmul(a, b, num_threads=2), a @ b, tol * 10)
            x = arr(3, 37) * 10
            m = rng.random(37) > 0.5
            close(fastattn.softmax(x, mask=m), ref.softmax(x, mask=m), tol)
            h = arr(2, 3, 5, 4)[:, ::-1]
            close(fastattn.merge_heads(h), ref.merge_heads(h), 0)
            close(fastattn.split_heads(fastattn.merge_heads(h), 3), h, 0)
    print("memcheck driver: every result matches the reference")


if __name__ == "__main__":
    main()
