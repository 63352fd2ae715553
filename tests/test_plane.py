"""The plane layout of 3-D convolutions (snack/nn/plane.py): the native layout kernels
(plane_kernels.cpp) against the torch copies and against the layout's definition."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import snack
from snack.nn.plane import _FromPlane, _native, _PlaneLayout, _ToPlane


@st.composite
def _geometries(draw):
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(3))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(3))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(3))
    sizes = tuple(draw(st.integers(1, 7)) for _ in range(3))
    before = tuple(draw(st.integers(0, 2)) for _ in range(3))  # (front, top, left)
    after = tuple(draw(st.integers(0, 2)) for _ in range(3))
    padded = tuple(s + b + a for s, b, a in zip(sizes, before, after))
    # the padded input holds at least one window
    kernel = tuple(min(k, (p - 1) // d + 1) for k, p, d in zip(kernel, padded, dilation))
    return kernel, stride, dilation, sizes, before, after, padded


def _layout(geometry, batch=2, channels=3):
    kernel, stride, dilation, _, _, _, padded = geometry
    return _PlaneLayout(kernel, stride, dilation, batch, channels, padded)


@settings(max_examples=60, deadline=None)
@given(geometry=_geometries(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_native_layout_matches_the_torch_copies_and_the_definition(geometry, dtype):
    _, stride, _, sizes, before, after, padded = geometry
    layout = _layout(geometry)
    x = torch.randn(2, 3, *sizes, dtype=dtype)
    assert _native(x)
    native = _ToPlane.apply(x, layout, before)
    with snack.use_backend("reference"):  # the native kernels do not run: the torch copies do
        copied = _ToPlane.apply(x, layout, before)
    assert torch.equal(native, copied)
    # the definition: the plane's padded volume is x zero padded by before, after and the layout's rounding
    volume = layout.volume_of(native)
    pad = []
    for size, b, total in reversed(list(zip(sizes, before, volume.shape[2:]))):
        pad += [b, total - b - size]
    assert torch.equal(volume, F.pad(x, pad))
    # and back: the input part of a plane
    plane = torch.randn_like(native)
    back = _FromPlane.apply(plane, layout, before, x.shape[2:])
    with snack.use_backend("reference"):
        assert torch.equal(back, _FromPlane.apply(plane, layout, before, x.shape[2:]))
    front, top, left = before
    depth, height, width = sizes
    expected = layout.volume_of(plane)[:, :, front : front + depth, top : top + height, left : left + width]
    assert torch.equal(back, expected)


def test_layout_kernels_take_empty_batches_and_refuse_an_input_that_does_not_fit():
    geometry = ((3, 3, 3), (2, 2, 2), (1, 1, 1), (5, 5, 5), (1, 1, 1), (1, 1, 1), (7, 7, 7))
    layout = _layout(geometry, batch=0)
    empty = torch.empty(0, 3, 5, 5, 5)
    assert _ToPlane.apply(empty, layout, (1, 1, 1)).shape == (0, 3, layout.rows, layout.places_w)
    layout = _layout(geometry)
    too_deep = torch.randn(2, 3, 9, 5, 5)
    with pytest.raises(RuntimeError, match="does not fit the layout"):
        torch.ops.snack_cpu.volume_to_plane(
            too_deep, layout.rows, layout.places_w, layout.stride, layout.planes, layout.places_h, (1, 1, 1)
        )
    with pytest.raises(RuntimeError, match="rows must be"):
        torch.ops.snack_cpu.volume_to_plane(
            torch.randn(2, 3, 5, 5, 5), layout.rows + 1, layout.places_w, layout.stride, layout.planes,
            layout.places_h, (1, 1, 1),
        )  # fmt: skip


def test_the_layout_is_differentiable_to_second_order_on_the_native_path():
    geometry = ((2, 3, 2), (2, 1, 3), (1, 2, 1), (4, 5, 6), (1, 0, 2), (0, 1, 1), (5, 6, 9))
    layout = _layout(geometry, batch=1, channels=2)
    x = torch.randn(1, 2, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _ToPlane.apply(t, layout, (1, 0, 2)), (x,))
    assert torch.autograd.gradgradcheck(lambda t: _ToPlane.apply(t, layout, (1, 0, 2)), (x,))
