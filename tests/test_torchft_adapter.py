"""torchft at arm's length (raytrain_lm/trainer/groups/torchft_adapter.py): the private
attributes we use are still there, on a real Manager (with a real Lighthouse and store), a real
DiLoCo and LocalSGD; and a torchft without them fails with a message that names them, not an
AttributeError deep in a step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from raytrain_lm.trainer.groups import torchft_adapter

pytestmark = pytest.mark.no_ray


@pytest.fixture(scope="module")
def manager():
    from torchft.coordination import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=1,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        replica_id="adapter-check",
        lighthouse_addr=lighthouse.address(),
        store_addr="127.0.0.1",
        store_port=store.port,
        hostname="127.0.0.1",
    )
    yield manager
    manager.shutdown(wait=False)
    lighthouse.shutdown()


def test_the_installed_torchft_has_what_the_adapter_uses(manager):
    from torchft.local_sgd import DiLoCo, LocalSGD

    torchft_adapter.check_manager(manager)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    inner = torch.optim.AdamW(model.parameters())
    outers = [torch.optim.SGD(part.parameters(), lr=0.7) for part in model]
    diloco = DiLoCo(
        manager, list(model), inner, outers, sync_every=4, backup_device=torch.device("cpu"),
        pin_memory=False,
    )  # fmt: skip
    torchft_adapter.check_diloco(diloco)
    assert len(torchft_adapter.diloco_fragments(diloco)) == 2
    local_sgd = LocalSGD(manager, model, inner, sync_every=4)
    torchft_adapter.check_local_sgd(local_sgd)
    # One group in the quorum: the average is the group's own weights.
    manager.start_quorum()
    averaged = torchft_adapter.average_parameters(local_sgd)
    assert all(torch.equal(a, p) for a, p in zip(averaged, model.parameters(), strict=True))
    torchft_adapter.forget_failed_quorum(manager)
    torchft_adapter.forget_failed_sync(manager)
    assert manager._quorum_future is None and manager._errored is None


def test_a_torchft_without_them_is_named_in_the_error():
    with pytest.raises(RuntimeError, match=r"lacks Manager\._errored, Manager\._quorum_future"):
        torchft_adapter.check_manager(SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"lacks DiLoCo\._fragments.*checked against torchft"):
        torchft_adapter.check_diloco(SimpleNamespace())
    renamed = SimpleNamespace(_fragments=[SimpleNamespace(prepare_sync=print)])
    with pytest.raises(RuntimeError, match=r"DiLoCo fragment\.perform_sync"):
        torchft_adapter.check_diloco(renamed)
    with pytest.raises(RuntimeError, match=r"lacks LocalSGD\._average"):
        torchft_adapter.check_local_sgd(SimpleNamespace())
