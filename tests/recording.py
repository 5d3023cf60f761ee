"""A stand-in for pipeline.tracking.StageRun that records what a stage logs, for assertions."""


class RecordingTracker:
    def __init__(self):
        self.metrics, self.points, self.series, self.tags, self.artifacts = {}, [], {}, {}, []

    def log_metrics(self, metrics, step=None):
        if step is None:
            self.metrics.update(metrics)
        else:
            self.points += [(k, step, v) for k, v in metrics.items()]

    def log_series(self, name, values, steps):
        self.series.setdefault(name, []).extend(zip(steps, values))

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append((str(path), artifact_path))

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_dict(self, data, name):
        self.artifacts.append((name, data))

    def log_dp_model(self, checkpoint, epsilon, delta, epsilon_composed=None, delta_composed=None, private=True,
                     budget=None):
        self.tags["logged_model"] = (str(checkpoint), epsilon, delta)
        self.tags["logged_model_epsilon_composed"] = epsilon_composed
        self.tags["logged_model_private"] = private

    def tag_dp_models(self, tags, budget=None):
        self.tags.update({f"model.{k}": v for k, v in tags.items()})
        return 1

    def curve(self, name) -> dict:
        """step -> value of a metric, from per-step logging and whole-series logging alike."""
        return {**dict(self.series.get(name, [])), **{s: v for k, s, v in self.points if k == name}}
