"""Operators' placement orders (pin / preload) and what a heartbeat answers a worker: the versions it
must retire and the orders that reach it; the catalog feed that tells gateways of deletions."""

import asyncio
from pathlib import Path

import grpc
import pytest
from flask.testing import FlaskClient

from registry.app import create_admin_app
from registry.grpc_service import SERVICE_NAME, add_registry_service
from registry.records import CatalogChange
from registry.store import RegistryStore
from services.common.errors import InvalidArgument, NotFound
from services.common.grpc_server import start_grpc_server
from tessera.v1 import registry_pb2, registry_pb2_grpc

from .conftest import BASE_MODEL

API_KEY = "test-admin-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(store: RegistryStore) -> FlaskClient:
    return create_admin_app(store, API_KEY).test_client()


def _orders(store: RegistryStore, worker_id: str, held: list[tuple[str, str]] = ()) -> tuple[list, dict[str, bool]]:
    orders = store.worker_orders(worker_id, held)
    return list(orders.retire), {adapter.name: pin for adapter, pin in orders.placements}


def test_orders_reach_the_named_workers_or_every_worker_of_the_base_model(store: RegistryStore, imports: Path) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    store.register_adapter("a2", BASE_MODEL, str(imports / "attn-qv"))
    w1 = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8).worker_id
    w2 = store.register_worker("127.0.0.1:7002", "cpu", BASE_MODEL, capacity=8).worker_id
    assert _orders(store, w1) == ([], {})

    store.place_adapter("a1", None, pin=False)          # preload everywhere
    store.place_adapter("a1", [w2], pin=True)           # and pin on w2
    placed = store.place_adapter("a2", [w1, w1], pin=False)
    assert [(o.adapter, o.worker_address, o.pin) for o in placed] == [("a2", "127.0.0.1:7001", False)]
    assert _orders(store, w1) == ([], {"a1": False, "a2": False})
    assert _orders(store, w2) == ([], {"a1": True})     # the pin wins over the everywhere preload
    assert [(o.worker_address, o.pin) for o in store.list_placement_orders("a1")] == [
        (None, False), ("127.0.0.1:7002", True)]

    store.place_adapter("a2", [w1], pin=True)           # an order given again takes the new pin
    assert _orders(store, w1)[1] == {"a1": False, "a2": True}
    # A restarted worker registers under a new id at the same address: its orders stay.
    w2_again = store.register_worker("127.0.0.1:7002", "cpu", BASE_MODEL, capacity=8).worker_id
    assert _orders(store, w2_again) == ([], {"a1": True})
    late = store.register_worker("127.0.0.1:7003", "cpu", BASE_MODEL, capacity=8).worker_id
    assert _orders(store, late) == ([], {"a1": False})  # "everywhere" includes workers that come later

    removed = store.remove_placement_orders("a1", [w2_again])
    assert [(o.worker_address, o.pin) for o in removed] == [("127.0.0.1:7002", True)]
    assert _orders(store, w2_again) == ([], {"a1": False})
    store.remove_placement_orders("a1", None)
    assert _orders(store, w2_again) == ([], {})
    with pytest.raises(NotFound, match="no placement order for all"):
        store.remove_placement_orders("a1", None)


def test_orders_refuse_unknown_adapters_and_workers_and_other_base_models(store: RegistryStore, imports: Path) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))
    worker = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8).worker_id
    other = store.register_worker("127.0.0.1:7002", "cpu", "other-base", capacity=8).worker_id
    with pytest.raises(NotFound, match="adapter 'nope'"):
        store.place_adapter("nope", None, pin=True)
    with pytest.raises(NotFound, match="worker 'ghost'"):
        store.place_adapter("a1", [worker, "ghost"], pin=True)
    with pytest.raises(InvalidArgument, match="serves base model 'other-base'"):
        store.place_adapter("a1", [other], pin=True)
    assert store.list_placement_orders("a1") == []      # nothing of a refused order stays
    with pytest.raises(NotFound, match="is not registered"):
        store.worker_orders("ghost", [])


def test_a_heartbeat_answers_which_held_versions_to_retire(store: RegistryStore, imports: Path) -> None:
    a1 = store.register_adapter("a1", BASE_MODEL, str(imports / "all-proj"))
    twin = store.register_adapter("twin", BASE_MODEL, str(imports / "all-proj"))  # the same files: one digest
    a2 = store.register_adapter("a2", BASE_MODEL, str(imports / "attn-qv"))
    assert twin.sha256 == a1.sha256 != a2.sha256
    worker = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8).worker_id
    held = [("a1", a1.sha256), ("twin", a1.sha256), ("a2", a2.sha256)]
    assert _orders(store, worker, held)[0] == []

    store.place_adapter("a1", None, pin=True)
    store.delete_adapter("a1")                          # its orders go with it
    assert _orders(store, worker, held) == ([("a1", a1.sha256)], {})  # twin still serves the digest
    store.delete_adapter("a2")
    store.register_adapter("a2", BASE_MODEL, str(imports / "all-proj"))  # the name again, other weights
    assert _orders(store, worker, held + [("a2", a1.sha256)])[0] == [("a1", a1.sha256), ("a2", a2.sha256)]


def test_deleting_an_adapter_is_published_after_its_commit(store: RegistryStore, imports: Path) -> None:
    async def scenario() -> list[CatalogChange]:
        with store.changes.subscribe() as changes:
            await asyncio.to_thread(store.register_adapter, "a1", BASE_MODEL, str(imports / "attn-qv"))
            seen = [await asyncio.wait_for(changes.get(), 5)]
            # Run from another thread (as the admin API's Flask threads do); the record is gone once announced.
            await asyncio.to_thread(store.delete_adapter, "a1")
            seen.append(await asyncio.wait_for(changes.get(), 5))
            with pytest.raises(NotFound):
                store.get_adapter("a1")
            return seen

    assert asyncio.run(scenario()) == [CatalogChange(), CatalogChange(removed_adapters=("a1",))]


def test_admin_api_pins_preloads_and_lifts_orders(client: FlaskClient, store: RegistryStore, imports: Path) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))
    worker = store.register_worker("127.0.0.1:7001", "cpu", BASE_MODEL, capacity=8).worker_id
    url = "/admin/v1/adapters/a1/placements"
    pinned = client.post(url, headers=AUTH, json={"workers": [worker], "pin": True})
    assert pinned.status_code == 200, pinned.get_json()
    assert [(o["worker_address"], o["pin"]) for o in pinned.get_json()["orders"]] == [("127.0.0.1:7001", True)]
    assert client.post(url, headers=AUTH, json={"workers": "all"}).status_code == 200  # pin defaults to false
    listed = client.get(url, headers=AUTH).get_json()["orders"]
    assert [(o["worker_address"], o["pin"]) for o in listed] == [(None, False), ("127.0.0.1:7001", True)]
    assert _orders(store, worker)[1] == {"a1": True}

    lifted = client.delete(f"{url}/{worker}", headers=AUTH)
    assert lifted.status_code == 200 and lifted.get_json()["removed"][0]["pin"] is True
    assert _orders(store, worker)[1] == {"a1": False}
    assert client.delete(f"{url}/all", headers=AUTH).status_code == 200
    assert client.get(url, headers=AUTH).get_json() == {"orders": []}
    again = client.delete(f"{url}/all", headers=AUTH)
    assert again.status_code == 404 and "no placement order for all" in again.get_json()["error"]["message"]


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("nope", {"workers": "all"}, 404, "adapter 'nope' is not registered"),
    ("a1", {"workers": ["ghost"]}, 404, "worker 'ghost' is not registered"),
    ("a1", {"workers": "some"}, 400, "must be \"all\" or a non-empty list of worker ids"),
    ("a1", {"workers": []}, 400, "non-empty list"),
    ("a1", {"workers": [3]}, 400, "non-empty list"),
    ("a1", {"workers": "all", "pin": "yes"}, 400, "field 'pin' must be a bool"),
    ("a1", {"pin": True}, 400, "missing required field 'workers'"),
    ("a1", {"workers": "all", "replicas": 2}, 400, "unknown field 'replicas'"),
    ("a1", [1], 400, "request body must be a JSON object"),
])
def test_admin_api_refuses_bad_placement_orders(client: FlaskClient, store: RegistryStore, imports: Path,
                                                path: str, body: object, status: int, message: str) -> None:
    store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))
    reply = client.post(f"/admin/v1/adapters/{path}/placements", headers=AUTH, json=body)
    assert reply.status_code == status and message in reply.get_json()["error"]["message"], reply.get_json()
    assert store.list_placement_orders("a1") == []


def test_heartbeat_and_catalog_watch_over_grpc(store: RegistryStore, imports: Path) -> None:
    a1 = store.register_adapter("a1", BASE_MODEL, str(imports / "attn-qv"))

    async def scenario() -> None:
        server = await start_grpc_server("127.0.0.1:0", add_registry_service(store, heartbeat_interval_ms=500),
                                         [SERVICE_NAME])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = registry_pb2_grpc.RegistryStub(channel)
                worker = (await stub.RegisterWorker(registry_pb2.RegisterWorkerRequest(
                    address="127.0.0.1:7001", device="cpu", base_model=BASE_MODEL, capacity=8))).worker_id
                await asyncio.to_thread(store.place_adapter, "a1", [worker], True)
                held = [registry_pb2.AdapterVersion(name="a1", sha256=a1.sha256)]
                beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id=worker, adapters=held))
                assert beat.known and not beat.retire
                assert [(p.adapter.name, p.adapter.sha256, p.adapter.storage_path, p.pin) for p in beat.placements] == [
                    ("a1", a1.sha256, a1.storage_path, True)]

                watch = stub.WatchCatalog(registry_pb2.WatchCatalogRequest())
                assert list((await watch.read()).removed_adapters) == []  # subscribed
                await asyncio.to_thread(store.delete_adapter, "a1")
                assert list((await asyncio.wait_for(watch.read(), 5)).removed_adapters) == ["a1"]
                watch.cancel()
                beat = await stub.Heartbeat(registry_pb2.HeartbeatRequest(worker_id=worker, adapters=held))
                assert list(beat.retire) == held and not beat.placements
        finally:
            await server.stop(grace_s=0)

    asyncio.run(scenario())
