# The two commands: `make demo` (a mode comparison on the embedded model) and `make test`.
# Both create .venv/ and install everything first (cobali with its dev, ray and plot extras), building
# llama-cpp-python if no cached wheel exists. A server alone needs none of the extras: `pip install .`.
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all lint clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $@

demo: $(STAMP)
	for mode in seq static cont; do \
		$(VENV)/bin/cobali run --mode $$mode --prompts workloads/prompts_16.txt --max-slots 16 \
			--prefill-chunk-tokens 256 --max-new 32 --json results/demo-$$mode.json || exit 1; \
	done

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m ''

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) results .pytest_cache
