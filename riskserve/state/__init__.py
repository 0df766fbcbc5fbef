"""Where everything that must survive a node lives: one database per pipeline, embedded SQLite by default
or PostgreSQL for a cluster (:mod:`riskserve.state.db`), holding the versions record every replica pulls
what it serves from (:mod:`riskserve.state.versions`), the feedback log, the audit trail and learner
checkpoints."""
