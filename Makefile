# sdnpu: every target sets up ./.venv itself (pinned packages, torch 2.13.0 CPU) before doing its job.
#   make convert MODEL=unet [SOURCE=sdxl-base|sdxl-turbo|tiny-sdxl|folder|file.safetensors] [OUT=dir] [RES=WxH|px[,...]|sdxl-buckets] [ADD=1]
#                [BATCH=B[,...]] [EXPORTER=dynamo|torchscript] [PRECISION=bf16|bfp16|fp16] [TARGET=amd-xdna2|qnn-htp]
#                [HTP_ARCH=v69|v73|v75|v79|v81] [HTP_OPT=1|2|3] [LORA="FILE[:SCALE] ..."]
#   make lora MODELS=models/sdxl-base LORA="FILE[:SCALE] ..." | make lora-remove MODELS=...
#   make generate PROMPT="a cat" [MODELS=models/sdxl-base] [STEPS=30] [GUIDANCE=5] [IMAGES=N] [IMAGE=image.png]
#                 [INIT=in.png [MASK=mask.png] [STRENGTH=s]]
#   make serve [MODELS=models/sdxl-base] [PORT=8080]
#   make test | make sweep | make fuzz [N=10000] [SEED=n] | make bench [FULL=1] | make clean

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

MODEL    ?= all
SOURCE   ?= sdxl-base
OUT      ?=
RES      ?=
BATCH    ?=
EXPORTER ?=
PRECISION ?=
TARGET   ?=
HTP_ARCH ?=
HTP_OPT  ?=
LORA     ?=
FULL     ?=
N        ?= 10000
SEED     ?=

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1

PROMPT   ?=
MODELS   ?= models/$(patsubst %.safetensors,%,$(notdir $(SOURCE)))
STEPS    ?=
GUIDANCE ?=
IMAGES   ?=
IMAGE    ?= image.png
INIT     ?=
MASK     ?=
STRENGTH ?=

PORT     ?= 8080

.PHONY: venv convert lora lora-remove generate serve test sweep fuzz bench clean

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV): pinned packages (torch 2.13.0 CPU), then sdnpu; pip's output goes to $(VENV)/setup.log"
	@: > $(VENV)/setup.log
	@# torch first and alone: an unpinned resolve would pull a multi-GB CUDA build
	@$(BIN)/python -m pip install --upgrade pip >> $(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@$(BIN)/python -m pip install torch==2.13.0 >> $(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@$(BIN)/python -m pip install -r requirements.lock >> $(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@$(BIN)/python -m pip install --no-deps --no-build-isolation -e . >> $(VENV)/setup.log 2>&1 || { cat $(VENV)/setup.log; exit 1; }
	@touch $@
	@echo "$(VENV) is ready"

convert: $(STAMP)
	$(BIN)/sdnpu convert --model $(MODEL) --source $(SOURCE) \
		$(if $(OUT),--out $(OUT)) $(if $(RES),--res $(RES)) $(if $(ADD),--add) $(if $(BATCH),--batch $(BATCH)) $(if $(EXPORTER),--exporter $(EXPORTER)) \
		$(if $(PRECISION),--precision $(PRECISION)) $(if $(TARGET),--target $(TARGET)) $(if $(HTP_ARCH),--htp-arch $(HTP_ARCH)) $(if $(HTP_OPT),--htp-optimization $(HTP_OPT)) \
		$(foreach l,$(LORA),--lora $(l))

lora: $(STAMP)
	@test -n "$(LORA)" || { echo 'make lora MODELS=models/sdxl-base LORA="style.safetensors:0.8 [more.safetensors ...]"'; exit 2; }
	$(BIN)/sdnpu lora apply $(MODELS) $(foreach l,$(LORA),--lora $(l))

lora-remove: $(STAMP)
	$(BIN)/sdnpu lora remove $(MODELS)

generate: $(STAMP)
	@test -n "$(PROMPT)" || { echo 'make generate PROMPT="a cat" [MODELS=models/sdxl-base] [STEPS=30] [GUIDANCE=5] [IMAGES=N] [IMAGE=image.png] [INIT=in.png [MASK=mask.png] [STRENGTH=s]]'; exit 2; }
	$(BIN)/sdnpu generate --models $(MODELS) --prompt "$(PROMPT)" $(if $(STEPS),--steps $(STEPS)) \
		$(if $(GUIDANCE),--guidance $(GUIDANCE)) $(if $(IMAGES),--num-images $(IMAGES)) \
		$(if $(INIT),--image $(INIT)) $(if $(MASK),--mask $(MASK)) $(if $(STRENGTH),--strength $(STRENGTH)) --out $(IMAGE)

serve: $(STAMP)
	$(BIN)/sdnpu serve $(MODELS) --port $(PORT)

# Two workers (pytest-xdist): much of the suite is single-threaded Python (torch's exporter, process start-up),
# so two run it in about two thirds of one's time on 2 cores (bench/results.md).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not sweep"

# The sweeps in full (every size pair and batch of every preset); `make test` runs the first case of each.
sweep: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m sweep

# Differential fuzzing of the compiler passes (tests/test_fuzz.py); `make test` runs 600 of these cases.
# A failing graph lands in fuzz-failures/ with the line that reproduces it.
fuzz: $(STAMP)
	SDNPU_FUZZ_N=$(N) $(if $(SEED),SDNPU_FUZZ_SEED=$(SEED)) $(BIN)/python -m pytest -q tests/test_fuzz.py -k matches_its_input

bench: $(STAMP)
	$(BIN)/python bench/bench_export.py $(if $(FULL),--full)
	$(BIN)/python bench/bench_compile.py $(if $(FULL),--sources tiny-sdxl,sdxl-base)
	$(BIN)/python bench/bench_peers.py $(if $(FULL),--full)
	$(BIN)/python bench/bench_lora.py $(if $(FULL),--models models/sdxl-base)
	$(if $(FULL),$(BIN)/python bench/bench_export.py --sources sdxl-base --components unet --compile)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
