# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAMP := $(VENV)/.installed

.PHONY: run test install lint restore push clean

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when the package definition or the pins change.
$(STAMP): pyproject.toml constraints.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,cluster]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	snakemake --cores all

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	snakemake --lint
	dpfm export-dvc --check

# Outputs restored by DVC get new mtimes; touch them in DAG order so Snakemake sees them up to date.
restore: $(STAMP)
	dvc pull
	snakemake --cores 1 --touch

push: $(STAMP)
	dvc commit --force
	dvc push

clean:
	rm -rf data models results logs .dpfm .snakemake mlflow.db mlartifacts
