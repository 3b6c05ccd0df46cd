"""WindowData on a window file and PNG images the tests write: the window file format, crops and
warps against an independent computation (images whose pixels are linear in x and y, which bilinear
interpolation reproduces exactly), context padding and square crops, mirror, mean and scale, the
foreground/background fractions, errors."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.graph import GraphError
from sncaffe.layers.window_data import c_round, resize_linear
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe import blobproto

ROWS, COLS = 48, 64


def gradient_image():
    """BGR uint8 (3, ROWS, COLS): B = 3x + 10, G = 4y + 20, R = 200 (exact under bilinear warps)."""
    y, x = np.mgrid[:ROWS, :COLS]
    return np.stack([3 * x + 10, 4 * y + 20, np.full_like(x, 200)]).astype(np.uint8)


def write_png(path, bgr):
    from PIL import Image
    Image.fromarray(np.ascontiguousarray(bgr[::-1].transpose(1, 2, 0))).save(path)


def window_file(tmp_path, images):
    """images: [(array, [(class_index, overlap, x1, y1, x2, y2), ...])] -> the window file's path."""
    lines = []
    for k, (arr, windows) in enumerate(images):
        name = f"img{k}.png"
        write_png(tmp_path / name, arr)
        lines += ["# %d" % k, name, "3", str(arr.shape[1]), str(arr.shape[2]), str(len(windows))]
        lines += [" ".join(map(str, w)) for w in windows]
    path = tmp_path / "windows.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def net(tmp_path, source, batch=4, crop=16, window="", transform="", seed=1):
    text = f"""
    layer {{ name: "data" type: "WindowData" top: "data" top: "label"
      window_data_param {{ source: "{source}" root_folder: "{tmp_path}/" batch_size: {batch} {window} }}
      transform_param {{ crop_size: {crop} {transform} }} }}"""
    return Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice("64MiB"), seed=seed)


def batches(n, count=1):
    out = []
    for _ in range(count):
        n.forward()
        out.append((n.blobs["data"].data.copy(), n.blobs["label"].data.copy()))
    return out


def expected_warp(box, out_h, out_w):
    """The linear image sampled as INTER_LINEAR samples the box (x1, y1, x2, y2) into out_h x out_w,
    computed from the pixel formula, not from an image."""
    x1, y1, x2, y2 = box
    sx = x1 + (np.arange(out_w) + 0.5) * (x2 - x1 + 1) / out_w - 0.5
    sy = y1 + (np.arange(out_h) + 0.5) * (y2 - y1 + 1) / out_h - 0.5
    sx, sy = np.clip(sx, x1, x2), np.clip(sy, y1, y2)          # border pixels repeat
    b = np.broadcast_to(3 * sx + 10, (out_h, out_w))
    g = np.broadcast_to((4 * sy + 20)[:, None], (out_h, out_w))
    return np.stack([b, g, np.full((out_h, out_w), 200.0)])


FG, BG = (3, 0.9, 10, 8, 29, 23), (0, 0.1, 40, 20, 55, 44)   # fg box 20x16, bg box 16x25
BG_CENTRAL = (0, 0.1, 20, 14, 29, 23)     # 10x10: grown by context_pad 4 (x2) it stays inside the image


@pytest.mark.parametrize("mirror", [False, True])
def test_warp_matches_the_sampled_box(tmp_path, mirror):
    src = window_file(tmp_path, [(gradient_image(), [FG, BG])])
    n = net(tmp_path, src, batch=8, window="fg_fraction: 0.5", transform=f"mirror: {str(mirror).lower()}")
    data, label = batches(n)[0]
    assert label.tolist() == [0] * 4 + [3] * 4                  # background first, then foreground
    flips = set()
    for item, (_, _, *box) in zip(range(8), [BG] * 4 + [FG] * 4):
        want = expected_warp(box, 16, 16)
        got = data[item]
        if mirror and not np.abs(got - want).max() <= 1:
            got, _ = got[:, :, ::-1], flips.add(item)
        np.testing.assert_allclose(got, want, atol=1.0, err_msg=f"item {item}")
    if mirror:
        assert 0 < len(flips) < 8           # a coin per window (P(all same) = 2^-7)


def test_context_pad_grows_the_box_and_pads_outside_the_image(tmp_path):
    """A 10x10 window at the image corner, crop 16, context_pad 4: context_scale 16/8 = 2, so the box
    becomes x, y in [round(5 - 10), round(5 + 10)] = [-5, 15], 21 wide; the 16 pixels inside the image
    warp to round(16 * 16/21) = 12 columns and rows after round(5 * 16/21) = 4 of zero padding."""
    corner = (2, 0.8, 0, 0, 9, 9)
    src = window_file(tmp_path, [(gradient_image(), [corner, BG])])
    n = net(tmp_path, src, batch=2, window="fg_fraction: 0.5 context_pad: 4")
    data, label = batches(n)[0]
    assert label.tolist() == [0, 2]
    item = data[1]
    assert not item[:, :4].any() and not item[:, :, :4].any()      # padding stays 0
    np.testing.assert_allclose(item[:, 4:, 4:], expected_warp((0, 0, 15, 15), 12, 12), atol=1.0)


def test_context_pad_mirror_mirrors_the_padding(tmp_path):
    corner = (2, 0.8, 0, 0, 9, 9)
    src = window_file(tmp_path, [(gradient_image(), [corner, BG])])
    n = net(tmp_path, src, batch=8, window="fg_fraction: 1 context_pad: 4", transform="mirror: true")
    data, _ = batches(n)[0]
    want = expected_warp((0, 0, 15, 15), 12, 12)
    seen = set()
    for item in data:
        if item[:, :, :4].any():                   # mirrored: the zero columns moved to the right
            assert not item[:, :, 12:].any() and not item[:, :4].any()
            np.testing.assert_allclose(item[:, 4:, :12], want[:, :, ::-1], atol=1.0)
            seen.add("mirrored")
        else:
            np.testing.assert_allclose(item[:, 4:, 4:], want, atol=1.0)
            seen.add("plain")
    assert seen == {"plain", "mirrored"}


def test_square_crop_mode(tmp_path):
    """crop_mode square, no context: the 20x16 box (centre 20, 16) becomes 20x20:
    x in [round(20 - 10), round(20 + 10)] = [10, 30], y in [round(16 - 10), round(16 + 10)] = [6, 26]."""
    src = window_file(tmp_path, [(gradient_image(), [FG, BG])])
    n = net(tmp_path, src, batch=2, window='fg_fraction: 0.5 crop_mode: "square"')
    data, _ = batches(n)[0]
    np.testing.assert_allclose(data[1], expected_warp((10, 6, 30, 26), 16, 16), atol=1.0)


def test_mean_value_and_scale(tmp_path):
    flat = np.stack([np.full((ROWS, COLS), v, np.uint8) for v in (30, 60, 90)])
    src = window_file(tmp_path, [(flat, [FG, BG])])
    n = net(tmp_path, src, batch=2, window="scale: 0.5 fg_fraction: 0.5",
            transform="mean_value: 10 mean_value: 20 mean_value: 30")
    data, _ = batches(n)[0]
    for c, v in enumerate((10, 20, 30)):
        assert np.all(data[:, c] == np.float32(v))               # (pixel - mean) * scale


def test_mean_file_is_read_at_its_centre_plus_the_padding(tmp_path):
    flat = np.full((3, ROWS, COLS), 100, np.uint8)
    corner = (2, 0.8, 0, 0, 9, 9)
    src = window_file(tmp_path, [(flat, [corner, BG_CENTRAL])])
    mean = np.arange(3 * 20 * 20, dtype=np.float32).reshape(1, 3, 20, 20) / 100
    bp = blobproto.from_array(mean, pb.BlobProto())
    (tmp_path / "mean.binaryproto").write_bytes(bp.SerializeToString())
    n = net(tmp_path, src, batch=2, window="fg_fraction: 0.5 context_pad: 4",
            transform=f'mean_file: "{tmp_path}/mean.binaryproto"')
    data, _ = batches(n)[0]
    off = (20 - 16) // 2                                            # mean_off, from the mean's width
    np.testing.assert_array_equal(data[0], np.float32(100) - mean[0, :, off:off + 16, off:off + 16])
    assert not data[1][:, :4].any()                                 # padding: 0, not -mean
    np.testing.assert_array_equal(data[1][:, 4:, 4:], np.float32(100) - mean[0, :, off + 4:off + 16, off + 4:off + 16])


def test_fg_bg_fraction_and_thresholds(tmp_path):
    """fg_threshold 0.6, bg_threshold 0.3: overlaps in [0.3, 0.6) are never drawn (their image is a
    colour no drawn window has); background labels are forced to 0; every batch of 20 holds
    int(20 * 0.3) = 6 foreground windows after 14 background ones."""
    fg = [(k, 0.6 + 0.1 * (k % 4), 0, 0, 20 + k, 20) for k in range(1, 6)]
    bg = [(k % 3, 0.05 * k, 5, 5, 30, 25) for k in range(6)]
    mid = [(9, 0.3, 0, 0, 30, 30), (9, 0.59, 5, 5, 20, 20)]
    colour = lambda v: np.full((3, ROWS, COLS), v, np.uint8)   # noqa: E731
    src = window_file(tmp_path, [(colour(50), fg + bg), (colour(77), mid)])
    n = net(tmp_path, src, batch=20, window="fg_threshold: 0.6 bg_threshold: 0.3 fg_fraction: 0.3")
    seen = set()
    for data, label in batches(n, 5):
        assert (label[:14] == 0).all() and (label[14:] > 0).all()
        assert np.unique(data).tolist() == [50]                     # no window of the 77 image
        seen.update(label[14:].tolist())
    assert seen == {1, 2, 3, 4, 5}                                  # every foreground window drawn


def test_repeats_with_the_seed_and_differs_with_another(tmp_path):
    src = window_file(tmp_path, [(gradient_image(), [FG, BG, (1, 0.7, 0, 0, 30, 30), (0, 0.2, 1, 2, 40, 40)])])
    runs = [batches(net(tmp_path, src, batch=6, transform="mirror: true", seed=s), 2) for s in (1, 1, 2)]
    for (a, la), (b, lb) in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    assert any(not np.array_equal(a, c) for (a, _), (c, _) in zip(runs[0], runs[2]))


def test_cache_images_gives_the_same_batches(tmp_path):
    src = window_file(tmp_path, [(gradient_image(), [FG, BG])])
    a = batches(net(tmp_path, src, batch=4), 2)
    b = batches(net(tmp_path, src, batch=4, window="cache_images: true"), 2)
    for (x, lx), (y, ly) in zip(a, b):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(lx, ly)


def test_resize_linear_matches_opencv():
    cv2 = pytest.importorskip("cv2", reason="OpenCV (opencv-python-headless) is not installed")
    rng = np.random.default_rng(1)
    for (h, w), (oh, ow) in [((7, 9), (16, 16)), ((30, 25), (16, 16)), ((16, 16), (16, 16)),
                             ((33, 12), (5, 7)), ((20, 20), (10, 10))]:
        src = rng.integers(0, 256, (3, h, w), dtype=np.uint8)
        ref = cv2.resize(np.ascontiguousarray(src.transpose(1, 2, 0)), (ow, oh), interpolation=cv2.INTER_LINEAR)
        got = resize_linear(src, oh, ow).transpose(1, 2, 0).astype(int)
        assert np.abs(got - ref).max() <= 1, (h, w, oh, ow)


def test_c_round_takes_halves_away_from_zero():
    assert [c_round(v) for v in (2.5, -2.5, 0.5, 1.49, -0.5)] == [3, -3, 1, 1, -1]


@pytest.mark.parametrize("lines,window,transform,message", [
    (["% 0"], "", "", 'expected "# image_index"'),
    (["# 1", "img0.png", "3 48 64", "0"], "", "", "image index 1, expected 0"),
    (["# 0", "img0.png", "1 48 64", "0"], "", "", "3 channels"),
    (["# 0", "img0.png", "3 48 64", "2", "3 0.9 1 1 5 5"], "", "", "ends where class_index"),
    (["# 0", "img0.png", "3 48 64", "1", "3 high 1 1 5 5"], "", "", "line 5: expected overlap"),
    (["# 0", "img0.png", "3 48 64", "1", "0 0.9 1 1 5 5"], "", "", "class_index > 0"),
    (["# 0", "img0.png", "3 48 64", "1", "3 0.9 1 1 5 5"], "", "", "no background window"),
    (["# 0", "img0.png", "3 48 64", "1", "0 0.1 9 1 5 5"], "", "", "0 <= x1 <= x2"),
    (["# 0", "img0.png", "3 48 64", "2", "3 0.9 1 1 5 5", "0 0 1 1 5 5"], "crop_size: 8", "", "legacy"),
    (["# 0", "img0.png", "3 48 64", "2", "3 0.9 1 1 5 5", "0 0 1 1 5 5"], 'crop_mode: "fit"', "", "crop_mode"),
    (["# 0", "img0.png", "3 48 64", "2", "3 0.9 1 1 5 5", "0 0 1 1 5 5"], "context_pad: 8", "", "context_pad 8"),
    (["# 0", "missing.png", "3 48 64", "2", "3 0.9 1 1 5 5", "0 0 1 1 5 5"], "", "", "missing.png"),
    (["# 0", "img0.png", "3 48 64", "2", "3 0.9 1 1 90 5", "0 0 1 1 5 5"], "fg_fraction: 1", "", "outside its image"),
])
def test_errors_name_the_layer_and_the_file(tmp_path, lines, window, transform, message):
    write_png(tmp_path / "img0.png", gradient_image())
    src = tmp_path / "windows.txt"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises((GraphError, ValueError), match=message) as e:
        n = net(tmp_path, src, window=window, transform=transform)
        n.forward()
    assert '"data"' in str(e.value)


def test_crop_size_is_needed(tmp_path):
    src = window_file(tmp_path, [(gradient_image(), [FG, BG])])
    with pytest.raises(GraphError, match='"data".*crop_size must be set'):
        net(tmp_path, src, crop=0)


def test_data_parallel_shards_read_one_big_batch(tmp_path):
    """Ranks r of 2 at batch 4 get rows 4r..4r+3 of one process at batch 8: the same windows, the
    same mirrors, the same background/foreground split."""
    windows = [FG, BG, (1, 0.7, 0, 0, 30, 30), (0, 0.2, 1, 2, 40, 40), (2, 0.95, 5, 5, 25, 35)]
    src = window_file(tmp_path, [(gradient_image(), windows)])
    whole = batches(net(tmp_path, src, batch=8, window="fg_fraction: 0.5", transform="mirror: true"), 2)
    for rank in range(2):
        n = net(tmp_path, src, batch=4, window="fg_fraction: 0.5", transform="mirror: true")
        n.layers[0].shard = (rank, 2)
        for (data, label), (big, big_label) in zip(batches(n, 2), whole):
            np.testing.assert_array_equal(data, big[4 * rank:4 * rank + 4])
            np.testing.assert_array_equal(label, big_label[4 * rank:4 * rank + 4])


def test_set_batch_reaches_window_data(tmp_path):
    from sncaffe.prototxt import set_batch
    text = 'layer { name: "d" type: "WindowData" top: "data" top: "label" window_data_param { batch_size: 5 } }'
    assert set_batch(parse_text(text, pb.NetParameter()), 3).layer[0].window_data_param.batch_size == 3


@pytest.mark.parametrize("mode", ["liveness", "offload", "recompute", "all"])
def test_trains_alike_in_every_memory_mode(tmp_path, mode):
    """WindowData -> Convolution -> ReLU -> InnerProduct -> SoftmaxWithLoss: the same bits as mode
    none, and the pool peak the plan says."""
    src = window_file(tmp_path, [(gradient_image(), [FG, BG, (2, 0.8, 3, 3, 40, 30)])])
    text = f"""
    layer {{ name: "data" type: "WindowData" top: "data" top: "label"
      window_data_param {{ source: "{src}" root_folder: "{tmp_path}/" batch_size: 4 context_pad: 2 }}
      transform_param {{ crop_size: 12 mirror: true mean_value: 100 }} }}
    layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
      convolution_param {{ num_output: 4 kernel_size: 3 stride: 2 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
    layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
      inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
    layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}"""

    def run(memory):
        device = CPUDevice("64MiB")
        n = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=device, memory=memory, seed=3)
        out = []
        for _ in range(2):
            device.pool.reset_peak()
            loss = n.forward()
            n.clear_param_diffs()
            n.backward()
            assert device.pool.peak == n.plan.peak
            out.append([np.float64(loss)] + [b.diff.copy() for bs in n.params.values() for b in bs])
            for bs in n.params.values():
                for b in bs:
                    b.data -= np.float32(0.1) * b.diff
        return out
    for got, want in zip(run(mode), run("none")):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, want))
