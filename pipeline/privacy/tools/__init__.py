"""Tools around the privacy boundary: the audits, the accounting CLI and the Opacus baselines."""
