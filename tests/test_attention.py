import pytest
import torch

from kvlab.attention import attention, causal_mask, naive_attention, repeat_kv, shares_heads_without_copy


def test_causal_mask_lets_each_query_see_itself_and_earlier():
    assert causal_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # Two new queries after three cached keys: they see the cache plus the causal part.
    assert causal_mask(2, 5).tolist() == [[True, True, True, True, False], [True] * 5]
    with pytest.raises(ValueError, match="q_len=4 must be <= k_len=3"):
        causal_mask(4, 3)


def test_repeat_kv_shares_each_kv_head_with_its_group():
    x = torch.randn(2, 3, 5, 4)
    y = repeat_kv(x, 2)
    assert y.shape == (2, 6, 5, 4)
    for h in range(6):
        assert torch.equal(y[:, h], x[:, h // 2])
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("q_len, k_len", [(6, 6), (1, 9), (3, 8)])
def test_teaching_maths_equals_fast_path(n_heads, n_kv_heads, q_len, k_len):
    q = torch.randn(2, n_heads, q_len, 16)
    k, v = torch.randn(2, n_kv_heads, k_len, 16), torch.randn(2, n_kv_heads, k_len, 16)
    mask = causal_mask(q_len, k_len)
    torch.testing.assert_close(naive_attention(q, k, v, mask), attention(q, k, v, mask))
    torch.testing.assert_close(naive_attention(q, k, v), attention(q, k, v))


def test_masked_keys_do_not_matter():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    mask = torch.tensor([[True, True, False, False]])  # (queries, keys)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 2:] += 100.0
    v2[:, :, 2:] -= 100.0
    torch.testing.assert_close(attention(q, k, v, mask), attention(q, k2, v2, mask))


@pytest.mark.parametrize("n_kv_heads", [2, 1])
@pytest.mark.parametrize("q_len, k_len", [(1, 9), (5, 5)])
def test_gqa_without_copies_equals_attention_over_copied_heads(n_kv_heads, q_len, k_len):
    """Sharing K/V heads inside the kernel (enable_gqa) gives exactly what attention over the
    repeat_kv copies gives, with and without a mask."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, q_len, 16, generator=g)
    k = torch.randn(2, n_kv_heads, k_len, 16, generator=g)
    v = torch.randn(2, n_kv_heads, k_len, 16, generator=g)
    n_rep = 4 // n_kv_heads
    for mask in (None, causal_mask(q_len, k_len)):
        copied = attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)
        assert torch.equal(attention(q, k, v, mask), copied)


def test_gqa_on_the_cpu_makes_no_full_size_copy_of_k_and_v():
    """On the CPU (PyTorch >= 2.5) no tensor of the expanded (B, H, S, D) shape is ever built."""
    if not shares_heads_without_copy(torch.zeros(1, device="cpu"), None):
        pytest.skip("this PyTorch's scaled_dot_product_attention has no enable_gqa (before 2.5)")
    from torch.utils._python_dispatch import TorchDispatchMode

    expanded = (1, 8, 64, 16)
    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    shapes.append(tuple(t.shape))
            return out

    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    with Shapes():
        attention(q, k, v)
    assert shapes and expanded not in shapes
    with Shapes():
        attention(q, repeat_kv(k, 4), repeat_kv(v, 4))   # the copying way does build it
    assert expanded in shapes
