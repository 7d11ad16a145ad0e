"""The word pools of the embedded corpus (``course_lib.corpus``): names, places, dates, and synonym sets
(any member may stand for the meaning). Data only; the same lists on every machine."""

COMPANIES = [
    "Acme Corp",
    "Globex",
    "Initech",
    "Umbrella Holdings",
    "Stark Industries",
    "Wayne Enterprises",
    "Hooli",
    "Vandelay Imports",
    "Cyberdyne Systems",
    "Soylent Foods",
    "Tyrell Group",
    "Oscorp",
    "Northwind Traders",
    "Contoso",
    "Fabrikam",
    "Blue Sun",
    "Pied Piper",
    "Monarch Airlines",
    "Gringotts Bank",
    "Aperture Labs",
    "Dunder Mifflin",
    "Massive Dynamic",
    "Nakatomi Trading",
    "Wonka Industries",
]
PEOPLE = [
    "John Smith",
    "Maria Garcia",
    "Wei Zhang",
    "Aiko Tanaka",
    "Peter Novak",
    "Fatima Khan",
    "David Brown",
    "Elena Petrova",
    "Carlos Silva",
    "Hannah Schmidt",
    "Kenji Sato",
    "Laura Rossi",
    "Omar Haddad",
    "Grace Lee",
    "Samuel Okafor",
    "Ingrid Berg",
    "Ravi Patel",
    "Chloe Martin",
    "Tom Walsh",
    "Yuki Mori",
]
CITIES = [
    "Boston",
    "Chicago",
    "Denver",
    "Seattle",
    "Atlanta",
    "Houston",
    "Phoenix",
    "Dallas",
    "Miami",
    "Portland",
    "Detroit",
    "Baltimore",
    "Toronto",
    "London",
    "Paris",
    "Berlin",
    "Madrid",
    "Tokyo",
    "Osaka",
    "Sydney",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
PERIODS = ["first-quarter", "second-quarter", "third-quarter", "fourth-quarter", "annual"]
ROLES = ["chief executive", "chairman", "finance chief", "president", "chief operating officer"]
ORGS = ["city council", "state senate", "school board", "federal agency", "county board", "parliament"]
FACILITIES = ["hospital", "bridge", "school", "power plant", "stadium", "library", "airport terminal"]
PRODUCTS = ["smartphone", "laptop", "electric car", "vaccine", "video game", "search engine", "drone"]
CROWDS = ["people", "protesters", "students", "workers", "fans"]

# Synonym sets: any member may stand for the meaning.
SYN = {
    "said": ["said", "stated", "announced", "reported"],
    "rose": ["rose", "increased", "climbed", "gained", "jumped"],
    "fell": ["fell", "dropped", "declined", "slipped", "decreased"],
    "profit": ["profit", "earnings", "net income"],
    "resigned": ["resigned", "stepped down", "quit"],
    "arrested": ["arrested", "detained", "took into custody"],
    "approved": ["approved", "endorsed", "backed", "passed"],
    "rejected": ["rejected", "voted down", "blocked", "refused"],
    "build": ["build", "construct", "erect"],
    "launch": ["launch", "release", "introduce", "unveil"],
    "delay": ["delay", "postpone", "push back"],
    "shares": ["shares", "stock"],
    "plan": ["plan", "proposal", "project"],
    "new": ["new", "modern"],
    "nearly": ["nearly", "almost", "close to"],
    "after": ["after", "following"],
    "reporters": ["reporters", "journalists", "the press"],
    "expected": ["expected", "likely", "set"],
    "cut": ["cut", "eliminate", "lay off"],
    "jobs": ["jobs", "positions", "workers"],
}
OPPOSITE = {"rose": "fell", "fell": "rose", "approved": "rejected", "rejected": "approved"}
