"""A provider in one module: `clouds.registry.PROVIDERS` is the one table from a target kind to
its provider, and job variables, adapters, bootstrap data and validation's advice are all read
through it (no second map, no per-kind if-chain). Pure: no Prefect server, no cloud."""
from __future__ import annotations

import ast

import pytest

from blocks.compute import resolve_target
from clouds.adapter import RUN_LABEL, CloudAdapter
from clouds.provider import JobVariablesError, Provider, WorkerResources
from clouds.registry import PROVIDERS, adapter_for, job_variables, provider_for, provider_of_builtin
from core.kinds import CLOUD_KINDS, TargetKind
from tests.cloud_fixtures import template
from tests.test_architecture import ROOT, project_files

POOL_KINDS = [kind for kind in TargetKind if kind.remote]
RES = WorkerResources(vcpu=1.0, memory_gb=1.0)


def test_every_kind_with_a_pool_has_exactly_one_provider_in_its_own_module():
    assert list(PROVIDERS) == POOL_KINDS  # in the kinds' order, each once
    modules = set()
    for kind, provider in PROVIDERS.items():
        assert issubclass(provider, Provider) and provider.kind is kind
        assert provider.__module__.startswith("clouds.") and provider.__module__ not in modules
        modules.add(provider.__module__)
        assert provider_for(kind) is provider_for(str(kind)) is provider_of_builtin(kind.builtin) is provider
        assert provider.pool_type() == kind.pool_type
    assert provider_for(TargetKind.INLINE) is None and provider_of_builtin(TargetKind.INLINE.builtin) is None


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_adapter_and_job_variables_come_through_the_registry(kind):
    provider = PROVIDERS[kind]
    target = resolve_target(kind.builtin)
    adapter = adapter_for(target)
    if kind.cloud:
        assert issubclass(provider.adapter, CloudAdapter) and type(adapter) is provider.adapter
        assert (adapter.work_pool, adapter.job_variables) == (target.work_pool, target.job_variables)
        out = job_variables(kind, RES, "r1", image="img", env={"A": "1"}, extra={"labels": {"team": "t"}})
        assert out == provider.job_variables(RES, "r1", image="img", env={"A": "1"}, extra={"labels": {"team": "t"}})
        # the run's label, and whatever labels the provider's capacity adds (docker's zooid.capacity)
        on_demand = provider.on_capacity(provider.size(RES, "r1"), "on_demand")["labels"]
        assert RUN_LABEL in on_demand and out["zooid_run_id"] == "r1" and out["labels"] == {"team": "t", **on_demand}
        assert (out["image"], out["env"]) == ("img", {"A": "1"})
        sized = provider.size(RES, "r1")  # its own SKU table's answer, under what the merge adds
        assert {k: out[k] for k in sized if k not in ("labels", "container_create_kwargs")} == \
            {k: v for k, v in sized.items() if k not in ("labels", "container_create_kwargs")}
    else:  # the process pool: nothing on a provider's clock, no worker size in its variables
        assert provider.adapter is None and adapter is None
        with pytest.raises(JobVariablesError, match="kind"):
            job_variables(kind, RES, "r1")
        with pytest.raises(JobVariablesError, match="kind"):
            provider.job_variables(RES, "r1")


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_bootstrap_data_fits_the_pool_template_it_ships(kind):
    """What a cloud bootstrap writes into a pool is declared by that pool's template, and a kind
    points at a cloud account exactly when its provider takes account options."""
    from deployments.bootstrap import POOL_TYPES

    provider = PROVIDERS[kind]
    assert POOL_TYPES[kind.builtin] == kind.pool_type
    assert bool(provider.account_options) == kind.cloud_account
    assert set(provider.account_required) <= set(provider.account_options)
    if kind.cloud_account:
        props = template(kind.pool_type)["variables"]["properties"]
        wanted = {*provider.account_options.values(), provider.credentials_variable} - {None}
        assert wanted <= set(props), wanted - set(props)
    assert provider.credentials_block({}) is None  # nothing in the environment: no block


def test_credentials_blocks_come_from_each_providers_environment():
    made = {kind: PROVIDERS[kind].credentials_block({"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "s",
                                                     "AZURE_CLIENT_ID": "c1", "AZURE_TENANT_ID": "t",
                                                     "AZURE_CLIENT_SECRET": "s"})
            for kind in POOL_KINDS}
    found = {kind: made[kind][0] for kind in POOL_KINDS if made[kind] is not None}
    assert found == {TargetKind.ECS: "zooid-aws", TargetKind.ACI: "zooid-azure"}
    assert made[TargetKind.ECS][1].aws_access_key_id == "AKIA1"
    assert made[TargetKind.ACI][1].client_id == "c1"
    assert all(PROVIDERS[kind].credentials_variable for kind in found)


def test_a_cloud_bootstrap_refuses_missing_account_options_before_any_call():
    from deployments.bootstrap import bootstrap_cloud

    with pytest.raises(ValueError, match="^resource_group: ACI needs resource_group and subscription_id$"):
        bootstrap_cloud(TargetKind.ACI.builtin)
    with pytest.raises(ValueError, match="^subscription_id: ACI needs resource_group and subscription_id$"):
        bootstrap_cloud(TargetKind.ACI.builtin, resource_group="rg")


def test_validation_reads_its_advice_from_the_provider():
    from deployments.bootstrap import main

    assert PROVIDERS[TargetKind.DOCKER].setup_command() == "`python -m deployments.stack up --docker`"
    assert PROVIDERS[TargetKind.ECS].setup_command() == \
        "`python -m deployments.bootstrap --target ecs` and `prefect deploy`"
    assert "Azure Blob" in PROVIDERS[TargetKind.ACI].store_suggestion
    assert [k for k in POOL_KINDS if PROVIDERS[k].blob_store] == [TargetKind.ACI]
    assert main(["--target", TargetKind.ECS.builtin, "--blob-container", "c"]) == 2  # refused before any call


def _names(tree: ast.AST) -> set[str]:
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names})


def _kind_members(tree: ast.AST) -> set[str]:
    """The `TargetKind.<MEMBER>` a module spells out."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "TargetKind"}


def test_the_registry_is_the_only_table_from_a_kind_to_its_provider():
    """A provider's class and its adapter's class are named only in its own module and the
    registry; no module but a provider's names a cloud kind's member to branch on it (one that
    names two or more is a second table or an if-chain; the local stack names the docker kind,
    whose engine it starts), and the bootstrap names no kind at all."""
    owners = {}
    for provider in PROVIDERS.values():
        owners[provider.__name__] = provider.__module__
        if provider.adapter is not None:
            owners[provider.adapter.__name__] = provider.__module__
    cloud_members = {kind.name for kind in CLOUD_KINDS}
    bad = []
    for module, path in project_files().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(ROOT)
        for name in _names(tree) & set(owners):
            if module not in (owners[name], "clouds.registry"):
                bad.append(f"{rel}: names {name}")
        if module == "core.kinds":
            continue
        members = _kind_members(tree) & cloud_members
        own = next((p.kind.name for p in PROVIDERS.values() if p.__module__ == module), None)
        if len(members) > 1 or (module.startswith("clouds.") and members - {own}):
            bad.append(f"{rel}: names kinds {sorted(members)}")
        if module == "deployments.bootstrap" and _kind_members(tree):
            bad.append(f"{rel}: branches on {sorted(_kind_members(tree))}")
    assert not bad, "\n".join(bad)
    assert owners["EcsAdapter"] == "clouds.ecs" and len(owners) == 2 * len(CLOUD_KINDS) + 1  # the reader sees them


def test_the_old_second_map_is_gone():
    assert not (ROOT / "clouds" / "job_variables.py").exists()
    assert set(CLOUD_KINDS) == {kind for kind, p in PROVIDERS.items() if p.adapter is not None}
