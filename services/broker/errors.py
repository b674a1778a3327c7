"""The broker's domain errors (DESIGN.md §2 codes); each names the field at fault and the reason."""

from __future__ import annotations

from typing import Any

from schemas.errors import BerthError


def _error(code: str, field: str, message: str, **details: Any) -> BerthError:
    return BerthError(message, code=code, field=field, details=details)


def resource_not_found(resource_id: str, field: str = "resource_id") -> BerthError:
    message = f"resource {resource_id} not found (unknown, or released)"
    return _error("resource_not_found", field, message, resource_id=resource_id)


def already_init(resource_id: str) -> BerthError:
    message = f"resource {resource_id} is already initialized"
    return _error("resource_already_init", "resource_id", message, resource_id=resource_id)


def already_launched(resource_id: str, status: str) -> BerthError:
    message = f"resource {resource_id} was already launched (status {status})"
    return _error(
        "application_already_launched", "resource_id", message, resource_id=resource_id, status=status
    )


def not_launched(resource_id: str, reason: str) -> BerthError:
    message = f"resource {resource_id} has no application: {reason}"
    return _error("application_not_found", "resource_id", message, resource_id=resource_id)


def not_running(resource_id: str, status: str) -> BerthError:
    message = f"resource {resource_id} is {status}, not running"
    return _error("resource_not_running", "resource_id", message, resource_id=resource_id, status=status)


def no_enough_resources(available: int, least: int, field: str = "filter.least_instance") -> BerthError:
    message = f"no enough resources: {available} instances available, at least {least} needed"
    return _error("no_enough_resources", field, message, available=available, least=least)


def broker_not_enough(available: int, need: int, broker: str) -> BerthError:
    message = f"broker {broker} needs {need} instances, {available} available"
    return _error(
        "broker_not_enough_resources", "instance", message, available=available, need=need, broker=broker
    )


def param_not_fit(user: str) -> BerthError:
    return _error("broker_param_not_fit", "param", f"no broker of user {user} fits the param", user=user)


def pool_empty(brokers: list[str]) -> BerthError:
    message = f"no ready resource in the fitting brokers {brokers}"
    return _error("broker_not_enough_resources", "param", message, brokers=brokers)


def cooling(brokers: list[str], until: float) -> BerthError:
    message = f"the fitting brokers {brokers} are empty and cooling after a launch failure"
    return _error("broker_cooling", "param", message, brokers=brokers, cooling_until=until)


def broker_not_found(user: str, name: str) -> BerthError:
    return _error("broker_not_found", "name", f"user {user} has no broker {name}", user=user, name=name)


def busy_launch(resource_id: str) -> BerthError:
    message = f"the launch of resource {resource_id} is still being handed to the operator; retry"
    return _error("busy", "resource_id", message, resource_id=resource_id)
