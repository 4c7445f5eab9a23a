"""rows_fingerprint: what encoded rows depend on, besides the features of the encoders a run recomputes."""

import torch

from verl_omni.data.actions import ActionNormalization
from verl_omni.models.wnm import WNMConfig, WNMModel
from verl_omni.models.wnm.encode_cache import rows_fingerprint


def _model(seed=0):
    torch.manual_seed(seed)
    return WNMModel(WNMConfig.from_size("tiny"))


def test_fingerprint_follows_what_rows_depend_on():
    model = _model()
    trained = ("text_encoder", "image_encoder")
    before = rows_fingerprint(model, trained)
    assert rows_fingerprint(_model(), trained) == before  # same weights, same rows
    with torch.no_grad():
        next(model.transformer.parameters()).add_(1.0)  # the DiT never enters a row
        next(model.text_encoder.parameters()).add_(1.0)  # recomputed by the adopting run
    assert rows_fingerprint(model, trained) == before
    assert rows_fingerprint(model, ("image_encoder",)) != before  # the text features would be kept: they changed
    with torch.no_grad():
        next(model.geometry_encoder.parameters()).add_(1.0)  # not recomputed: its cached features are stale
    assert rows_fingerprint(model, trained) != before


def test_fingerprint_covers_the_vae_statistics_and_action_normalization():
    trained = ("text_encoder", "image_encoder", "geometry_encoder")
    ref = rows_fingerprint(_model(), trained)
    m = _model()
    m.set_latent_statistics([0.5] * m.config.latent_channels, [2.0] * m.config.latent_channels)
    assert rows_fingerprint(m, trained) != ref
    m = _model()
    n = len(m.action_normalization.mean)
    m.action_normalization = ActionNormalization(mean=(0.1,) * n, std=(1.0,) * n)
    assert rows_fingerprint(m, trained) != ref
    m = _model()
    with torch.no_grad():
        next(m.vae.parameters()).mul_(0.5)
    assert rows_fingerprint(m, trained) != ref
