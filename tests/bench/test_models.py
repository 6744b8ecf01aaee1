"""Models of the study: every family builds, runs forward, and sizes follow their flags."""

from __future__ import annotations

import pytest
import torch

from snapstate.bench.models import GPTConfig, build_model, count_params, parse_count, parse_model


@pytest.mark.parametrize("name", ["vgg16:w=0.0625", "resnet18:w=0.0625", "resnet50:w=0.0625"])
def test_cifar_models_classify_32x32_images(name: str) -> None:
    model = build_model(name)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_full_width_models_have_the_published_sizes() -> None:
    # Parameter counts of the CIFAR variants (no torchvision to compare with, so pinned here).
    assert count_params(build_model("resnet18")) == 11_173_962
    assert count_params(build_model("vgg16")) == 14_724_042


def test_gpt_size_follows_the_flag() -> None:
    small, large = (count_params(build_model(f"gpt:p={p}")) for p in ("1M", "20M"))
    assert 0.5e6 < small < 2e6 and 10e6 < large < 40e6
    cfg = GPTConfig.for_params(parse_count("1B"))
    assert cfg.dim == 64 * cfg.layers


def test_gpt_predicts_next_tokens() -> None:
    model = build_model("gpt:l=1,d=64,v=50,t=8")
    assert model(torch.randint(0, 50, (2, 8))).shape == (2, 8, 50)


def test_same_seed_same_weights() -> None:
    a, b = build_model("resnet18:w=0.0625", seed=4), build_model("resnet18:w=0.0625", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_bad_names_say_what_is_known() -> None:
    with pytest.raises(ValueError, match="known"):
        parse_model("alexnet")
    with pytest.raises(ValueError, match="key=value"):
        parse_model("gpt:10M")
    assert parse_model("gpt:p=10M").name == "gpt:p=10M"
    assert parse_count("1.5B") == 1_500_000_000
