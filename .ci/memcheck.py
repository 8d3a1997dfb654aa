"""A few calls of every kernel for valgrind's memcheck (run by .ci/memcheck.sh).

memcheck sees what AddressSanitizer cannot: reads of scratch memory that
was never written.  Such a value only shows when something depends on it,
so every result here is compared with the NumPy reference.  Shapes are
small but cross the kernels' block edges: the row kernel (<= 4 query rows)
and the block kernel, partial query and key blocks, partial micro-tiles,
decoding with the keys split in pieces (and pieces that sequences share,
read together), strided, reversed and broadcast
operands, masks, GQA (query heads grouped), paged caches in every storage,
the int8 mode's integer products, a smoothed and rotated cache, rotary,
the backward (dense and packed),
every SIMD path valgrind runs (it hides AVX-512 from the program:
AddressSanitizer covers that one)."""
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
            # decoding with grouped query heads (4 over 1 key/value head), split
            gq, k, v = arr(1, 4, 1, 16), arr(1, 1, 2100, 16), arr(1, 1, 2100, 8)
            close(fastattn.scaled_dot_product_attention(gq, k, v, enable_gqa=True),
                  ref.scaled_dot_product_attention(gq, k, v, enable_gqa=True), tol)
            # heads folded into the block kernel's columns (16 over 1; 4 over
            # 1 of 3 rows), odd sizes, per-head slopes and sinks, lse
            for G, L in ((16, 1), (4, 3)):
                gq, k, v = arr(1, G, L, 13), arr(1, 1, 300, 13), arr(1, 1, 300, 7)
                opts = dict(enable_gqa=True, is_causal=True, causal_alignment="lower_right",
                            alibi_slopes=rng.random(G), sinks=rng.standard_normal(G))
                out, lse = fastattn.scaled_dot_product_attention(gq, k, v, return_lse=True,
                                                                 **opts)
                r_out, r_lse = ref.scaled_dot_product_attention(gq, k, v, return_lse=True, **opts)
                close(out, r_out, tol)
                close(lse, r_lse, tol * 100)
            # a paged cache: blocks of 5 in a shuffled pool, a prefill chunk,
            # a decoding token of a split sequence, speculative tokens
            lens, q_lens = np.array([70, 2100, 9]), np.array([67, 1, 2])
            need = -(-lens // 5)
            kc, vc = arr(int(need.sum()) + 2, 1, 5, 16), arr(int(need.sum()) + 2, 1, 5, 8)
            order = rng.permutation(kc.shape[0]).astype(np.int32)
            table = np.zeros((3, need.max()), np.int32)
            starts = np.concatenate([[0], np.cumsum(need)])
            for i in range(3):
                table[i, :need[i]] = order[starts[i]:starts[i + 1]]
            cu = np.concatenate([[0], np.cumsum(q_lens)])
            pq = arr(int(cu[-1]), 2, 16)
            close(fastattn.paged_attention(pq, kc, vc, table, lens, cu, num_threads=2),
                  ref.paged_attention(pq, kc, vc, table, lens, cu), tol)
            # a tree mask over the last 2 positions of the third sequence only
            tree = np.array([True, False, True, True])
            close(fastattn.paged_attention(pq, kc, vc, table, lens, cu, tree_mask=tree,
                                           tree_mask_indptr=np.array([0, 0, 0, 4])),
                  ref.paged_attention(pq, kc, vc, table, lens, cu, tree_mask=tree,
                                      tree_mask_indptr=np.array([0, 0, 0, 4])), tol)
            # three sequences sharing their first 2100 positions' blocks (pieces
            # of 1024 read together, fa_attn_parts), of lengths past them
            shared_lens = np.array([2101, 2130, 3100])
            blocks = -(-shared_lens // 64)
            skc, svc = arr(int(blocks.sum()), 1, 64, 16), arr(int(blocks.sum()), 1, 64, 8)
            stable = np.zeros((3, blocks.max()), np.int32)
            at = 0
            for i in range(3):  # the first 32 blocks (2048 positions) are sequence 0's
                own = np.arange(at, at + blocks[i]) if i == 0 else np.concatenate(
                    [stable[0, :32], np.arange(at, at + blocks[i] - 32)])
                stable[i, :blocks[i]] = own
                at += blocks[i] if i == 0 else blocks[i] - 32
            sq = arr(6, 2, 16)
            scu = np.array([0, 1, 3, 6])
            close(fastattn.paged_attention(sq, skc, svc, stable, shared_lens, scu),
                  ref.paged_attention(sq, skc, svc, stable, shared_lens, scu), tol)
            # smooth_k and rotate_k: the key mean's term in both kernels
            k, v = arr(1, 2, 75, 40), arr(1, 2, 75, 24)
            smooth = fastattn.KVCache(1, 2, 80, 40, value_dim=24, dtype=dtype, smooth_k=True,
                                     rotate_k=True)
            smooth.append(k, v)
            for sq in (arr(1, 4, 3, 40), arr(1, 4, 70, 40)):
                close(smooth.attend(sq, softcap=3.0),
                      ref.scaled_dot_product_attention(sq, k, v, is_causal=True, enable_gqa=True,
                                                       causal_alignment="lower_right",
                                                       softcap=3.0), tol * 10)
            # the backward: chunks of keys over partial key and query blocks,
            # GQA, a mask, softcap and sinks; packed sequences
            q, k, v, do = arr(1, 4, 67, 9), arr(1, 2, 300, 9), arr(1, 2, 300, 7), arr(1, 4, 67, 7)
            opts = dict(enable_gqa=True, attn_mask=rng.random((67, 300)) > 0.3, is_causal=True,
                        causal_alignment="lower_right", softcap=3.0, sinks=rng.standard_normal(4))
            out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **opts)
            for g, r in zip(fastattn.attention_backward(do, q, k, v, out, lse, num_threads=2,
                                                        **opts),
                            ref.attention_backward(do, q, k, v, **opts)):
                close(g, r, tol * 10)
            cu_q, cu_k = np.array([0, 5, 72]), np.array([0, 140, 300])
            vq, vk, vv, vdo = arr(72, 4, 9), arr(300, 2, 9), arr(300, 2, 7), arr(72, 4, 7)
            out, lse = fastattn.varlen_attention(vq, vk, vv, cu_q, cu_k, is_causal=True,
                                                 return_lse=True)
            grads = fastattn.varlen_attention_backward(vdo, vq, vk, vv, out, lse, cu_q, cu_k,
                                                       is_causal=True, num_threads=2)
            want = ref.attention_backward(*(x[5:].transpose(1, 0, 2) for x in (vdo, vq)),
                                          *(x[140:].transpose(1, 0, 2) for x in (vk, vv)),
                                          is_causal=True, enable_gqa=True,
                                          causal_alignment="lower_right")
            close(grads[0][5:].transpose(1, 0, 2), want[0], tol * 10)
            close(grads[1][140:].transpose(1, 0, 2), want[1], tol * 10)
            if dtype == np.float32:  # int8 and 16-bit caches, read by the float32 kernels
                sc = (rng.random(kc.shape[:3]) + 0.5).astype(np.float32)
                codes = rng.integers(-127, 128, kc.shape).astype(np.int8)
                vcodes = rng.integers(-127, 128, vc.shape).astype(np.int8)
                exact = fastattn.paged_attention(pq, codes, vcodes, table, lens, cu, k_scale=sc,
                                                 v_scale=sc)
                close(exact, ref.paged_attention(pq, codes * sc[..., None], vcodes * sc[..., None],
                                                 table, lens, cu), 1e-3)
                # the int8 mode: integer products, features and keys past whole vectors;
                # the decoding rows against the exact ones, the prefill chunk (the block
                # kernel's, whose softmax these keys make sharp enough for the query's
                # rounding to move its largest weight) against the twin of that rounding
                mode = fastattn.paged_attention(pq, codes, vcodes, table, lens, cu, k_scale=sc,
                                                v_scale=sc, precision="int8", num_threads=2)
                close(mode[67:], exact[67:], 0.02 * np.abs(exact).max())
                rows = table[0, :need[0]]
                twin = ref.paged_attention(ref.int8_query(pq[:67]), (codes * sc[..., None])[rows],
                                           (vcodes * sc[..., None])[rows],
                                           np.arange(need[0], dtype=np.int32)[None], lens[:1],
                                           cu[:2])
                close(mode[:67], twin, 0.02 * np.abs(twin).max())
                cache = fastattn.KVCache(2, 2, 80, 40, storage="int4")
                cache.append(arr(2, 2, 75, 40), arr(2, 2, 75, 40))
                q4 = arr(2, 4, 1, 40)
                exact = cache.attend(q4)
                close(cache.attend(q4, precision="int8"), exact, 0.02 * np.abs(exact).max())
                cos, sin = np.cos(arr(40, 8)), np.sin(arr(40, 8))
                pos = rng.integers(0, 40, pq.shape[0])
                close(fastattn.rotary(pq, pos, cos, sin), ref.rotary(pq, pos, cos, sin), 0)
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
