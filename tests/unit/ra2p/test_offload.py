"""ModelOffloader: bit-exact round trips, real freeing, identities kept (plain torch modules)."""

from __future__ import annotations

import torch

from tide_megatron.trainer.offload import ModelOffloader, OffloadConfig


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 64))
    model[2].weight = model[0].weight  # tied: one storage, moved once
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (4, 8))
    model(ids).square().mean().backward()
    opt.step()
    return model, opt, ids


def _snapshot(model, opt):
    state = [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return ([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()], state)


def test_round_trip_is_bit_exact_and_frees_storage():
    model, opt, ids = _model_and_optimizer()
    params, grads, state = _snapshot(model, opt)
    param_objects = [id(p) for p in model.parameters()]
    before = model(ids).detach()
    offloader = ModelOffloader(model, OffloadConfig(optimizer_state=True), optimizer=opt)
    moved = offloader.nbytes
    offloader.offload()
    assert not offloader.resident
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert offloader.nbytes == moved
    offloader.restore()
    assert offloader.resident
    after_params, after_grads, after_state = _snapshot(model, opt)
    for a, b in zip(params + grads + state, after_params + after_grads + after_state):
        assert torch.equal(a, b)
    assert [id(p) for p in model.parameters()] == param_objects
    assert torch.equal(model(ids).detach(), before)


def test_tied_and_shared_storages_move_once():
    model, opt, _ = _model_and_optimizer()
    tensors = [model[0].weight, model[1].weight, model[1].bias, model[2].bias]  # model[2].weight is model[0]'s
    expected = sum(t.untyped_storage().nbytes() for t in tensors)
    assert ModelOffloader(model, OffloadConfig(grads=False)).nbytes == expected


def test_views_into_one_flat_buffer_survive():
    """Megatron DDP's `main_grad` are views into one contiguous grad buffer: offloading frees the
    buffer once and the views read the restored bytes."""
    model = torch.nn.Linear(16, 8)
    flat = torch.randn(8 * 16 + 8)
    model.weight.main_grad = flat[: 8 * 16].view(8, 16)
    model.bias.main_grad = flat[8 * 16:]
    expected = flat.clone()
    offloader = ModelOffloader(model, OffloadConfig(params=False))
    assert offloader.nbytes == flat.numel() * 4
    offloader.offload()
    assert flat.untyped_storage().nbytes() == 0
    offloader.restore()
    assert torch.equal(torch.cat([model.weight.main_grad.reshape(-1), model.bias.main_grad]), expected)


def test_idempotent_and_timed():
    model, opt, _ = _model_and_optimizer()
    offloader = ModelOffloader(model)
    assert offloader.restore() == 0.0  # already resident
    assert offloader.offload() > 0.0
    assert offloader.offload() == 0.0
    assert offloader.restore() > 0.0


def test_dropping_frees_without_a_host_copy_and_restore_reallocates_for_a_refill():
    """A leaving actor drops its state (other DP replicas hold it); a parked reference may drop
    its host copy (reloaded from disk): either way restore gives the storages back, shapes
    intact, for the caller to fill."""
    for dropped_later in (False, True):
        model, opt, _ = _model_and_optimizer()
        params, _, _ = _snapshot(model, opt)
        cfg = OffloadConfig(optimizer_state=True, keep_host_copy=dropped_later)
        offloader = ModelOffloader(model, cfg, optimizer=opt)
        moved = offloader.nbytes
        offloader.offload()
        if dropped_later:
            offloader.drop_host_copy()
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        offloader.restore()
        assert offloader.nbytes == moved
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params):
                assert p.shape == saved.shape
                p.copy_(saved)  # the refill (a state transfer, a checkpoint read)
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), params))
