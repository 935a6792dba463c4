FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY refundops refundops
COPY approvals approvals
COPY audit audit
COPY processors processors
COPY templates templates
COPY manage.py ./
RUN pip install --no-cache-dir . && python manage.py collectstatic --noinput -v0
EXPOSE 8000
CMD ["gunicorn", "refundops.asgi:application", "-k", "uvicorn_worker.UvicornWorker", "-w", "4", "-b", "0.0.0.0:8000"]
