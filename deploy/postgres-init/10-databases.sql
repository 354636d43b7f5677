-- Runs once, when PostgreSQL starts on an empty data volume (/docker-entrypoint-initdb.d), as POSTGRES_USER.
-- POSTGRES_DB made the registry's database `pelt`; MLflow's tracking server keeps its own, `mlflow`.
CREATE DATABASE mlflow OWNER pelt;
