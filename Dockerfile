# RefundOps image: production mode, as a non-root user. The image alone refuses to start until it is
# given DJANGO_SECRET_KEY, AUDIT_KEY, DATABASE_URL and REDIS_URL (docker-compose.yml passes .env).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    REFUNDOPS_ENV=production STATIC_ROOT=/app/static REFUNDOPS_VAR_DIR=/app/var
WORKDIR /app
RUN useradd --system --uid 10001 --create-home --home-dir /home/refundops refundops
# Pango and a font for WeasyPrint (the evidence pack's summary.pdf), from Debian's packages.
RUN apt-get update && apt-get install -y --no-install-recommends libpango-1.0-0 libpangoft2-1.0-0 fonts-dejavu-core \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first, from the lock file: a code change reuses this layer.
COPY requirements.lock ./
RUN pip install --no-deps --require-hashes -r requirements.lock

COPY manage.py gunicorn.conf.py ./
COPY refundops refundops
COPY approvals approvals
COPY audit audit
COPY processors processors
COPY roles roles
COPY proposals proposals
COPY templates templates
# The code runs from /app as it is (nothing to install); static files are collected at build time
# (development settings for this one step: collectstatic needs no secret).
RUN REFUNDOPS_ENV=development python manage.py collectstatic --noinput -v0 \
    && mkdir -p /app/var/evidence-packs && chown -R refundops /app/var

USER refundops
EXPOSE 8000
CMD ["gunicorn", "refundops.asgi:application", "-c", "gunicorn.conf.py"]
