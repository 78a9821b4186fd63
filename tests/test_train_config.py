"""Recipe loading, overrides, layout checks, DeepSpeed config filling and --dry-run (no processes)."""

from __future__ import annotations

import io
import json
import re
import subprocess

import pytest
import yaml

from common.constants import REPO_ROOT
from common.errors import RecipeError, UserError
from data_pipeline.config import VAL_FRACTION, parse_data
from pretrain.config import load_recipe
from pretrain.dry_run import dry_run
from pretrain.layout import build_ds_config, plan_layout
from pretrain.loaders import loader
from pretrain.loop import lr_at
from pretrain.train import main
from pretrain.train import main as train_main

RECIPE = "recipes/tiny_cpu.yaml"


def test_recipes_load_and_overrides_apply():
    cfg = load_recipe(
        RECIPE,
        ["train.lr=1e-3", "model.variant=frozen_qk", "data.task_args.n_pairs=4", "train.global_batch_sequences=16"],
    )
    assert cfg.optim.lr == 1e-3 and cfg.model.variant == "frozen_qk"
    assert cfg.data.task_args == {"n_pairs": 4} and cfg.global_batch_size == 16
    assert load_recipe("recipes/wikitext2_cpu.yaml").data.source.startswith("text:")


@pytest.mark.parametrize(
    "override, hint",
    [
        ("train.learning_rate=1", "lr"),
        ("optim.warmup=3", "warmup_steps"),
        ("model.varient=mixit", "variant"),
        ("trian.seq_len=3", "train"),
        ("parallel.zero_stage=2", "ds_config"),
    ],
)
def test_unknown_keys_name_close_matches(override, hint):
    with pytest.raises(RecipeError, match=hint):
        load_recipe(RECIPE, [override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.hidden_size=abc", "model.hidden_size='abc' has type str; expected int"),
        ("model.num_heads=5", "not divisible by num_heads=5"),
        ("model.preset=xxs", "did you mean 'xs'"),
        ("model.rope_scaling=3", "model.rope_scaling=3 has type int"),
    ],
)
def test_the_model_section_is_typed_and_checked_at_load(override, message):
    """The model section's names, types and shape are refused when the recipe loads, before any data is read;
    what loads keeps exactly the keys the recipe set (the rest come from the preset and the data)."""
    with pytest.raises(UserError, match=message):
        load_recipe(RECIPE, [override])
    section = load_recipe(RECIPE, ["model.variant=mixit"]).model
    assert section.variant == "mixit" and section.to_dict()["preset"] == section.preset
    assert load_recipe(RECIPE, [f"model={json.dumps(section.to_dict())}"]).model == section


def test_batch_size_in_tokens_or_sequences():
    cfg = load_recipe(RECIPE, ["train.global_batch_sequences=null", "train.global_batch_tokens=256"])
    assert cfg.global_batch_size == 8 and cfg.tokens_per_step == 256
    with pytest.raises(RecipeError, match="exactly one"):
        load_recipe(RECIPE, ["train.global_batch_tokens=256"])
    with pytest.raises(RecipeError, match="multiple of train.seq_len"):
        load_recipe(RECIPE, ["train.global_batch_sequences=null", "train.global_batch_tokens=100"])
    with pytest.raises(RecipeError, match="fp16"):
        load_recipe(RECIPE, ["train.precision=fp16"])


def test_impossible_layouts_are_refused_with_the_reason():
    with pytest.raises(RecipeError, match="ZeRO stage 0 or 1 only.*zero1"):
        plan_layout(load_recipe(RECIPE, ["parallel.pipeline_stages=2", "parallel.ds_config=zero2"]), 2)
    with pytest.raises(RecipeError, match="not divisible by parallel.pipeline_stages"):
        plan_layout(load_recipe(RECIPE, ["parallel.pipeline_stages=2", "parallel.ds_config=pipeline"]), 3)
    with pytest.raises(RecipeError, match="micro_batch_sequences"):
        plan_layout(load_recipe(RECIPE, ["train.micro_batch_sequences=3"]), 2)
    with pytest.raises(RecipeError, match="neither a file nor a name"):
        plan_layout(load_recipe(RECIPE, ["parallel.ds_config=zero5"]), 1)
    pipe0 = ["parallel.pipeline_stages=2", "parallel.ds_config=zero0"]
    with pytest.raises(RecipeError, match="bf16 pipeline parallelism needs ZeRO-1.*ds_config=pipeline"):
        plan_layout(load_recipe(RECIPE, pipe0 + ["train.precision=bf16", "train.grad_clip=0"]), 2)
    with pytest.raises(RecipeError, match="first stage's gradients only.*ds_config=pipeline.*grad_clip=0"):
        plan_layout(load_recipe(RECIPE, pipe0), 2)
    assert plan_layout(load_recipe(RECIPE, pipe0 + ["train.grad_clip=0"]), 2).zero_stage == 0


def test_ds_config_is_filled_from_the_recipe(tmp_path):
    cfg = load_recipe(RECIPE, ["parallel.ds_config=pipeline", "parallel.pipeline_stages=2", "train.precision=bf16"])
    layout = plan_layout(cfg, 4)
    ds = build_ds_config(cfg, layout, on_cpu=True)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        8,
        4,
        1,
    )
    assert ds["bf16"]["enabled"] and ds["data_types"]["grad_accum_dtype"] == "fp32"
    assert ds["optimizer"]["params"]["lr"] == cfg.optim.lr and ds["optimizer"]["params"]["torch_adam"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 1}, "train_batch_size": 4}))
    with pytest.raises(RecipeError, match="recipe owns"):
        plan_layout(load_recipe(RECIPE, [f"parallel.ds_config={bad}"]), 1)


def test_every_ds_config_template_plans():
    stages = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero2_offload": 2, "zero3_offload": 3, "cpu": 1}
    for name, stage in stages.items():
        assert plan_layout(load_recipe(RECIPE, [f"parallel.ds_config={name}"]), 2).zero_stage == stage


def test_zero2_and_zero3_templates_carry_cluster_defaults_and_the_dry_run_shows_them(tmp_path):
    """Communication overlapped with the backward pass; ZeRO-3 keeps tensors up to 10 x hidden whole
    and sizes its buckets from the hidden size ("auto"); DeepSpeed's own config parser accepts them."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # deferred: heavy (deepspeed)

    for name in ("zero2", "zero3", "zero2_offload", "zero3_offload"):
        cfg = load_recipe(RECIPE, [f"parallel.ds_config={name}"])
        zero = build_ds_config(cfg, plan_layout(cfg, 2), on_cpu=True, hidden_size=256)["zero_optimization"]
        assert zero["overlap_comm"] is True and zero["contiguous_gradients"] is True, name
        parsed = DeepSpeedZeroConfig(**zero)
        assert parsed.overlap_comm and parsed.reduce_bucket_size >= 256 * 256, name
        if zero["stage"] == 3:
            assert (
                zero["reduce_bucket_size"],
                zero["stage3_prefetch_bucket_size"],
                zero["stage3_param_persistence_threshold"],
            ) == (65536, 58982, 2560)
            assert parsed.param_persistence_threshold == 2560 and parsed.max_live_parameters == 10**9
    out = io.StringIO()
    info = dry_run(load_recipe(RECIPE, ["parallel.ds_config=zero3"]), 2, out=out)
    assert info["zero_optimization"]["stage3_param_persistence_threshold"] == 640  # tiny: hidden 64
    assert '"overlap_comm": true' in out.getvalue() and '"stage3_param_persistence_threshold": 640' in out.getvalue()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}))
    with pytest.raises(RecipeError, match=r"sub_group_size.*cannot be \"auto\".*Fix: give a number"):
        plan_layout(load_recipe(RECIPE, [f"parallel.ds_config={bad}"]), 2)


def test_every_template_parses_and_the_memory_estimate_counts_its_buckets(tmp_path):
    """Every ds_configs/ template, filled from a recipe, passes DeepSpeed's own config parser (what the engine
    reads). The dry run's memory estimate holds the communication buffers DeepSpeed 0.19 allocates, so a
    bigger bucket shows there: ZeRO-1/2 one reduce bucket of gradients, two with overlap_comm; ZeRO-3 one and
    a prefetch bucket of parameters; and ZeRO-3's tensors kept whole (the persistence threshold) count whole."""
    from common.deepspeed_import import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig  # deferred: heavy (deepspeed)

    for path in sorted((REPO_ROOT / "ds_configs").glob("*.json")):
        cfg = load_recipe(RECIPE, [f"parallel.ds_config={path.stem}"])
        layout = plan_layout(cfg, 1)
        parsed = DeepSpeedConfig(build_ds_config(cfg, layout, on_cpu=True, hidden_size=64))
        assert parsed.zero_optimization_stage == layout.zero_stage, path.name

    def memory(zero: dict, *overrides: str) -> dict[str, float]:
        path = tmp_path / f"template{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"zero_optimization": zero}))
        cfg = load_recipe(RECIPE, [f"parallel.ds_config={path}", *overrides])
        return {k[:-4]: v * 2**30 for k, v in dry_run(cfg, 2, out=io.StringIO())["memory_per_rank_gib"].items()}

    small = memory({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 10**6})
    big = memory({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 10**7})
    assert big["comm_buffers"] - small["comm_buffers"] == pytest.approx(2 * 9 * 10**6 * 4)  # two fp32 buckets
    assert big["total"] - small["total"] == pytest.approx(big["comm_buffers"] - small["comm_buffers"])
    assert memory({"stage": 2, "reduce_bucket_size": 10**7})["comm_buffers"] == pytest.approx(10**7 * 4)
    bf16 = memory({"stage": 2, "overlap_comm": True, "reduce_bucket_size": 10**7}, "train.precision=bf16")
    assert bf16["comm_buffers"] == pytest.approx(2 * 10**7 * 2)
    zero3 = memory({"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 5000})
    assert zero3["comm_buffers"] == pytest.approx((1000 + 5000) * 4)
    whole = memory({"stage": 3, "stage3_param_persistence_threshold": 10**9})  # every tensor whole on each rank
    split = memory({"stage": 3, "stage3_param_persistence_threshold": 0})  # every tensor halved over 2 ranks
    assert whole["weights"] == pytest.approx(2 * split["weights"])
    assert memory({"stage": 0})["comm_buffers"] == 0


def test_lr_schedule_warmup_then_decay_to_min():
    cfg = load_recipe(RECIPE, ["train.max_steps=100", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1"])
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)
    lin = load_recipe(
        RECIPE,
        ["train.max_steps=100", "optim.warmup_steps=0", "optim.decay=linear", "optim.lr=1.0", "optim.min_lr=0.0"],
    )
    assert lr_at(lin, 50) == pytest.approx(0.5)


def test_wsd_schedule_warmup_stable_then_1_sqrt_decay_to_min():
    base = ["train.max_steps=100", "optim.warmup_steps=10", "optim.lr=1.0", "optim.min_lr=0.1", "optim.decay=wsd"]
    cfg = load_recipe(RECIPE, [*base, "optim.decay_fraction=0.2"])
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10:80] == [1.0] * 70  # stable: the peak until the last 20% of the steps
    for s in range(80, 100):  # 1-sqrt of the decay's progress, min_lr at the last step
        assert lrs[s] == pytest.approx(0.1 + 0.9 * (1 - ((s - 79) / 20) ** 0.5))
    assert lrs[79] > lrs[80] > lrs[90] > lrs[99] == pytest.approx(0.1)
    # a cooldown branch: decay_start names the step, the decay runs to the (new) max_steps
    branch = load_recipe(RECIPE, [*base, "optim.decay_start=40", "train.max_steps=50"])
    assert [lr_at(branch, s) for s in range(40)] == lrs[:40]
    assert lr_at(branch, 40) < 1.0 and lr_at(branch, 49) == pytest.approx(0.1)
    constant = load_recipe(RECIPE, [*base, "optim.decay=constant"])  # what a stable run is before a branch
    assert [lr_at(constant, s) for s in range(40)] == lrs[:40]
    with pytest.raises(RecipeError, match="decay_fraction"):
        load_recipe(RECIPE, [*base, "optim.decay_fraction=1.5"])
    with pytest.raises(RecipeError, match="inside the warmup"):
        load_recipe(RECIPE, [*base, "optim.decay_start=5"])
    with pytest.raises(RecipeError, match="optim.decay must be one of"):
        load_recipe(RECIPE, [*base, "optim.decay=step"])


def test_dry_run_prints_plan_and_refuses(capsys):
    out = io.StringIO()
    info = dry_run(load_recipe(RECIPE, ["model.variant=frozen_qk", "parallel.ds_config=zero3"]), 2, out=out)
    text = out.getvalue()
    for word in ("resolved config", "trainable", "frozen", "FLOPs per token", "memory per rank", "ZeRO-3"):
        assert word in text
    assert info["params_frozen"] > 0 and info["params_trainable"] > 0
    assert (
        main(
            [
                "--recipe",
                RECIPE,
                "--dry-run",
                "--world-size",
                "2",
                "parallel.pipeline_stages=2",
                "parallel.ds_config=zero3",
            ]
        )
        == 2
    )
    assert "ZeRO stage 0 or 1 only" in capsys.readouterr().err


WORLD = {"1b_gpu_zero1.yaml": 64, "8b_gpu_pipeline.yaml": 32, "tiny_cpu.yaml": 2, "wikitext2_cpu.yaml": 2}


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO_ROOT / "recipes").glob("*.yaml")))
def test_every_recipe_dry_runs(recipe):
    """Planned without their data: a GPU recipe's shards are on its cluster, not here."""
    info = dry_run(load_recipe(f"recipes/{recipe}"), WORLD.get(recipe, 1), out=io.StringIO(), data=False)
    assert info["params_trainable"] > 0 and info["train_flops_per_token"] > 0


def test_adamw_groups_hold_trainable_tensors_only():
    from model import preset
    from model.transformer import build_model
    from pretrain.engine import param_groups

    cfg = load_recipe(RECIPE, ["model.variant=frozen_qk", "model.tie_embeddings=true"])
    model = build_model(preset("tiny", variant="frozen_qk", vocab_size=50, max_seq_len=32, tie_embeddings=True), seed=0)
    decay, no_decay = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    dn = {names[id(p)] for p in decay["params"]}
    nn_ = {names[id(p)] for p in no_decay["params"]}
    assert not any(".q_proj." in n or ".k_proj." in n for n in dn | nn_)
    assert decay["weight_decay"] == cfg.optim.weight_decay and no_decay["weight_decay"] == 0.0
    assert "embed_tokens.weight" in nn_ and all("layernorm" in n or n.startswith(("norm", "embed")) for n in nn_)
    assert len(dn | nn_) == sum(1 for p in model.parameters() if p.requires_grad)


def test_print_config_shows_the_resolved_recipe(capsys):
    assert main(["--recipe", RECIPE, "--print-config", "train.lr=1e-3", "data.task_args.n_pairs=4"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    cfg = load_recipe(RECIPE, ["data.task_args.n_pairs=4"])
    assert resolved["optim"]["lr"] == 1e-3 and resolved["data"]["task_args"] == {"n_pairs": 4}
    # every default is filled in, the model section resolved with the data's vocabulary
    assert resolved["data"]["val_fraction"] == VAL_FRACTION and resolved["data"]["seed"] == cfg.seed
    assert resolved["model"]["vocab_size"] == loader(cfg, "train").vocab_size and "preset" not in resolved["model"]
    assert out.startswith("# resolved recipe; model.vocab_size=") and "(from the data)" in out.splitlines()[0]


@pytest.mark.parametrize(
    "data",
    [{"source": "data/shards"}, {"source": "synthetic:kv_retrieval"}, {"source": "text:x"}, {"source": "classify:x"}],
)
def test_every_data_source_holds_out_the_same_default_fraction(data):
    assert parse_data(data).val_fraction == VAL_FRACTION


def test_dry_run_refuses_data_the_run_would_refuse(tmp_path, capsys):
    """--dry-run reads the data as the run does: a data.source that does not exist is one error line and
    exit 2 (it exited 0, saying "data not readable" on line 139 of 145); --without-data plans without it."""
    missing = tmp_path / "no-shards"
    args = ["--recipe", "recipes/tiny_cpu.yaml", "--dry-run", f"data.source={missing}"]
    assert train_main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: data: data directory {missing} does not exist"), err
    assert err[0].endswith("plan without the data: --dry-run --without-data") and not captured.out
    assert train_main([*args, "--without-data"]) == 0
    assert "vocab_size: 32000 (preset default; the data was not read: --without-data)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a plan's option only
        train_main(["--recipe", "recipes/tiny_cpu.yaml", "--without-data"])
    assert "it goes with --dry-run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, match",
    [
        ("logging.wandb={projekt: p}", r"logging.wandb: unknown keys \['projekt'\]"),
        ("eval.tasks=[bpb]", "eval.tasks: unknown task 'bpb'"),
        ("eval.tasks=[bits_per_byte]", "need the run's tokenizer"),
    ],
)
def test_dry_run_checks_what_the_launch_checks(override, match, capsys):
    """A queued job is refused when it is planned: --dry-run validates the trackers and eval.tasks."""
    assert train_main(["--recipe", "recipes/tiny_cpu.yaml", "--dry-run", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and re.search(match, err[0])


def test_nothing_a_test_recipe_or_front_door_command_uses_lies_outside_the_repository():
    """A clone with nothing beside it (a user's machine) runs the tests, the recipes and the README:
    none of them may name the data folder that sits next to this repository on the team's machines."""
    beside = re.compile(r"\.\./" + 'shared|parents?\\b[^\\n]*/ *"' + 'shared"')
    tracked = subprocess.run(
        ["git", "ls-files", "tests", "recipes", "README.md", "demo.sh", ".ci", "data/sample"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    named = [
        f"{f}:{n}"
        for f in tracked
        if (REPO_ROOT / f).suffix in ("", ".py", ".yaml", ".yml", ".sh", ".md", ".json", ".txt")
        and (REPO_ROOT / f).is_file()
        for n, line in enumerate((REPO_ROOT / f).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if beside.search(line)
    ]
    assert not named, f"these name data outside the repository (ship or generate it instead): {named}"
