# One image for every berth worker; compose.yaml picks the service with `berth worker <name>`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bus bus
COPY schemas schemas
COPY services services
COPY berth berth
RUN pip install --no-cache-dir .
ENTRYPOINT ["berth"]
