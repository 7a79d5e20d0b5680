"""`deployments.bootstrap` against a real Prefect API: idempotent, and a second bootstrap keeps
what an earlier one (or the UI) set in the pool's template unless it is given anew."""
from __future__ import annotations

import pytest

from clouds.registry import PROVIDERS
from deployments.bootstrap import bootstrap, bootstrap_cloud, main


def _defaults(pool: str) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        props = client.read_work_pool(pool).base_job_template["variables"]["properties"]
    return {k: v.get("default") for k, v in props.items()}


@pytest.mark.usefixtures("prefect_api")
def test_the_docker_pool_gets_its_image_and_environment_and_keeps_them():
    env = {"PREFECT_HOME": "/tmp/prefect", "PREFECT_DEFAULT_RESULT_STORAGE_BLOCK": "s3-bucket/results"}
    first = bootstrap("docker", image="localhost/zooid-worker:cpu-abc", env=env)
    assert first["work_pool"] == "zooid-docker" and first["image"] == "localhost/zooid-worker:cpu-abc"
    got = _defaults("zooid-docker")
    assert got["image"] == "localhost/zooid-worker:cpu-abc" and got["env"] == env
    assert got["image_pull_policy"] == "Never" and got["auto_remove"] is False
    again = bootstrap("docker")  # nothing given anew: the image and environment stay
    assert again["pool"] == "updated" and _defaults("zooid-docker") == got
    assert main(["--target", "docker", "--image", "localhost/zooid-worker:cpu-def", "--env", "A=1"]) == 0
    now = _defaults("zooid-docker")
    assert now["image"] == "localhost/zooid-worker:cpu-def" and now["env"] == {"A": "1"}


@pytest.mark.usefixtures("prefect_api")
def test_a_cloud_bootstrap_takes_the_environment_and_a_later_one_keeps_the_cluster(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    done = bootstrap_cloud("ecs", cluster="zooid-cluster", env={"PREFECT_DEFAULT_RESULT_STORAGE_BLOCK": "s3-bucket/r"})
    assert done["defaults"] == ["cluster"]
    got = _defaults("zooid-ecs")
    assert got["cluster"] == "zooid-cluster" and got["env"] == {"PREFECT_DEFAULT_RESULT_STORAGE_BLOCK": "s3-bucket/r"}
    bootstrap("ecs")
    assert _defaults("zooid-ecs") == got


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("target", [provider.kind.builtin for provider in PROVIDERS.values()])
def test_every_targets_pool_is_accepted_by_the_api(target):
    """The server validates a pool's template (every placeholder a declared variable): each
    provider's pool (`clouds.registry.PROVIDERS`) is created with the template Zooid ships, and
    reads back with it."""
    from prefect.client.orchestration import get_client

    from deployments.bootstrap import POOL_TYPES, base_job_template

    done = bootstrap(target)
    assert done["work_pool"] == f"zooid-{target}"
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool(f"zooid-{target}")
    assert pool.type == POOL_TYPES[target]
    shipped = base_job_template(POOL_TYPES[target])
    assert pool.base_job_template["job_configuration"] == shipped["job_configuration"]


@pytest.mark.usefixtures("prefect_api")
@pytest.mark.parametrize("target", [p.kind.builtin for p in PROVIDERS.values() if p.account_options])
def test_a_cloud_bootstrap_writes_each_providers_account_options(target, monkeypatch):
    """`bootstrap_cloud` is one loop over the provider's data: each option it takes lands in the
    pool variable its provider names, and nothing else does."""
    for name in ("AWS_ACCESS_KEY_ID", "AZURE_CLIENT_ID"):
        monkeypatch.delenv(name, raising=False)
    provider = PROVIDERS[next(k for k in PROVIDERS if k.builtin == target)]
    given = {"cluster": "c1", "resource_group": "rg1", "subscription_id": "sub1", "namespace": "ns1"}
    done = bootstrap_cloud(target, **given)
    wanted = {variable: given[option] for option, variable in provider.account_options.items()}
    assert done["defaults"] == sorted(wanted) and "credentials_block" not in done
    got = _defaults(f"zooid-{target}")
    assert {k: got[k] for k in wanted} == wanted
