"""The search: MCMC over SOAP configs scored by the simulator (``search()``)."""

from soapsearch.search.api import SearchResult, search
from soapsearch.search.mcmc import Budget, plan_cost

__all__ = ["Budget", "SearchResult", "plan_cost", "search"]
